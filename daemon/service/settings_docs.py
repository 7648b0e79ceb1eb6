"""docs/settings.md, made from the declarations in settings.py.

``python -m prefixd.daemon.service.settings_docs > docs/settings.md`` writes
it again; a unit test fails while the file and the declarations disagree.
"""

from __future__ import annotations

import sys

from .settings import GROUPS, SETTINGS, Setting

PREFACE = """\
# Settings of `prefixd serve`

<!-- Made from daemon/service/settings.py by `python -m prefixd.daemon.service.settings_docs > docs/settings.md`. -->

Every setting has one key, written three ways: `cache_bytes` in the config file (`cache-bytes` works too),
`PREFIXD_CACHE_BYTES` in the environment, `--cache-bytes` on the command line. **Precedence: flags >
environment > config file > defaults.** A list such as `model` is taken whole from the first source that has
it; in the environment it is comma-separated, on the command line the flag is repeated. A switch is given as
a bare flag, `true`/`false` in the file, and `1`/`0`, `yes`/`no`, `on`/`off` or `true`/`false` in the
environment. Sizes are bytes, or `512M`, `4G`, `1.5GiB`.

The config file is TOML: `$XDG_CONFIG_HOME/prefixd/config.toml` (`~/.config/prefixd/config.toml`, on macOS
too), or the file named by `--config PATH` / `$PREFIXD_CONFIG` (a missing default file is fine, a missing
named one is an error). `prefixd config [--json] [serve flags...]`
prints the effective configuration, as a config file, with where each value came from. A bad value, or an
unknown key in the file, stops the daemon at start-up with the key and its source.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _row(setting: Setting) -> str:
    flag = f"`{setting.flag} {setting.metavar}`" if setting.metavar else f"`{setting.flag}`"
    if setting.kind.repeatable:
        flag += " (repeatable)"
    value = setting.kind.name + (", per model as NAME=VALUE" if setting.per_model else "")
    return f"| {flag} | `{setting.key}` | {_cell(value)} | {_cell(setting.default_text())} | {_cell(setting.help)} |"


def settings_markdown() -> str:
    parts = [PREFACE]
    for group in GROUPS:
        parts.append(
            f"\n## {group[0].upper()}{group[1:]}\n\n| flag | key | value | default | what |\n|---|---|---|---|---|\n"
        )
        parts.append("".join(_row(setting) + "\n" for setting in SETTINGS.values() if setting.group == group))
    return "".join(parts)


if __name__ == "__main__":
    sys.stdout.write(settings_markdown())
