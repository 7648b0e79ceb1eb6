"""The daemon as a process: command line, configuration, logs, systemd and launchd, lifecycle."""
