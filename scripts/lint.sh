#!/usr/bin/env bash
# Lint and format check with ruff (rules in pyproject.toml, [tool.ruff]), the services' layers and import cycles
# with import-linter ([tool.importlinter]), then every pre-commit hook (.pre-commit-config.yaml) over the whole
# tree; CI runs it through scripts/test.sh.
# Fix what it reports with: .venv/bin/ruff check --fix . && .venv/bin/ruff format . (and the files the
# pre-commit hooks rewrite: trailing whitespace, final newlines).
# PRE_COMMIT=0 skips the hooks (they install their tools from PyPI on first use, into ~/.cache/pre-commit).
set -uo pipefail
cd "$(dirname "$0")/.."
ruff="${RUFF:-.venv/bin/ruff}"
status=0
"$ruff" check . || status=1
"$ruff" format --check . || status=1
"${LINT_IMPORTS:-.venv/bin/lint-imports}" --no-logo || status=1
if [ "${PRE_COMMIT:-1}" != 0 ]; then
  tools=.venv-pre-commit
  if [ ! -x "$tools/bin/pre-commit" ]; then
    python3 -m venv "$tools" && "$tools/bin/python" -m pip install -q -r requirements/pre-commit.txt || exit 1
  fi
  # in a checkout without git history (an exported tree) there is nothing for pre-commit to read
  if git rev-parse --git-dir >/dev/null 2>&1; then
    "$tools/bin/pre-commit" run --all-files --show-diff-on-failure || status=1
  fi
fi
exit $status
