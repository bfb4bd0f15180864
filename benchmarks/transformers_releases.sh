#!/usr/bin/env bash
# The transformers releases pyproject accepts, tested: each release given (default: the lowest
# accepted, 5.0.0, and the newest on the index) installed into a scratch virtual environment with
# torch==2.13.0 and mixprec's test extras, then the tests of the Hugging Face models and their
# experts run there. Prints one line per release and exits non-zero if any failed.
#   bash benchmarks/transformers_releases.sh [RELEASE ...]
# Outside the suite: each release takes a few minutes to install (the pip cache makes it faster).
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=${TESTS:-"tests/narrow/test_hf_experts.py tests/models/test_hf.py"}
releases=("$@")
if [ ${#releases[@]} -eq 0 ]; then
    newest=$(python3 -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')
    releases=(5.0.0 "${newest:?cannot read the newest transformers release from the index}")
fi
status=0
summary=()
for release in "${releases[@]}"; do
    root=$(mktemp -d)
    python3 -m venv "$root/venv"
    (
        . "$root/venv/bin/activate"
        python -m pip install --quiet --upgrade pip
        python -m pip install --quiet torch==2.13.0
        python -m pip install --quiet -e '.[test]' "transformers==$release"
        python -c "import transformers; print('transformers', transformers.__version__)"
        python -m pytest -q -n 2 -p no:cacheprovider $TESTS
    ) > "$root/log" 2>&1
    rc=$?
    line="transformers $release: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$root/log" | tail -1) (exit $rc; log $root/log)"
    echo "$line"
    summary+=("$line")
    [ $rc -eq 0 ] || status=1
done
printf '%s\n' "${summary[@]}"
exit $status
