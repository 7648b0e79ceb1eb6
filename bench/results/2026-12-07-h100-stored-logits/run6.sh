# 2026-12-07: an exact repeat samples its first token from the stored prompt end's logits (this tree) against a416439 (.gpu/base)
set -u
BUDGET_S=170 ALT_TREE=.gpu/base bash bench/gpu_session.sh floor32k hits-raw hits-raw-alt 2>&1 | tail -45
