#!/usr/bin/env bash
# Run the container image and check it serves: /v2/health/ready turns 200 (every embedded model has a
# warm worker), then one OIP inference on `sim` and one embedding on `minilm` answer. Prints the seconds
# to ready. Runs as the image's own user with a read-only root filesystem, as deploy/ runs it.
#
#   deploy/container-smoke.sh [IMAGE]        default IMAGE: localhost/inferd:dev
#   ENGINE=docker deploy/container-smoke.sh  (default: podman)
#   ENGINE_ARGS="--runtime runc ..."         extra engine options, before the command (docs/deploy.md:
#                                            a sandboxed host)
#   RUN_ARGS="--ulimit nofile=1024:1024 ..." extra `run` options
#
# Build the image first (docs/deploy.md); the full build compiles llama.cpp, about 20 minutes on a small
# machine, which is why this is a manual check and not part of the test suite. It checks the slim image
# (WITH_LLAMA=0) as well: neither check needs smollm2.
set -euo pipefail
IMAGE="${1:-localhost/inferd:dev}"
ENGINE="${ENGINE:-podman}"
PORT="${PORT:-18000}"
read -r -a extra <<<"${ENGINE_ARGS:-}"
read -r -a run_extra <<<"${RUN_ARGS:-}"
name="inferd-smoke-$$"
cleanup() { "$ENGINE" "${extra[@]}" rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT
start=$SECONDS
"$ENGINE" "${extra[@]}" run "${run_extra[@]}" -d --name "$name" --read-only --tmpfs /tmp -p "127.0.0.1:$PORT:8000" "$IMAGE" >/dev/null
for _ in $(seq 1 180); do  # bounded: 180 x 1 s
    if curl -sf "http://127.0.0.1:$PORT/v2/health/ready" >/dev/null; then
        echo "ready after $((SECONDS - start)) s"
        break
    fi
    if [ "$("$ENGINE" "${extra[@]}" inspect -f '{{.State.Running}}' "$name")" != "true" ]; then
        "$ENGINE" "${extra[@]}" logs "$name" | tail -30
        echo "error: the container exited" >&2
        exit 1
    fi
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v2/health/ready" >/dev/null || { "$ENGINE" "${extra[@]}" logs "$name" | tail -30; echo "error: not ready in 180 s" >&2; exit 1; }
# whole answers first, then their start: `curl | head -c` would fail the script (curl's write error 23
# under pipefail) whenever the answer is longer than what head keeps
infer=$(curl -sf "http://127.0.0.1:$PORT/v2/models/sim/infer" -H 'Content-Type: application/json' \
    -d '{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["hello"]}]}')
echo "${infer:0:200}"
[[ "$infer" == *'"name":"OUTPUT0"'* ]] || { echo "error: no OUTPUT0 in sim's answer" >&2; exit 1; }
embedding=$(curl -sf "http://127.0.0.1:$PORT/v1/embeddings" -H 'Content-Type: application/json' \
    -d '{"model": "minilm", "input": ["a cat sat on the mat"]}')
echo "${embedding:0:120}"
[[ "$embedding" == *'"embedding":['* ]] || { echo "error: no embedding in minilm's answer" >&2; exit 1; }
"$ENGINE" "${extra[@]}" exec "$name" id
echo "ok"
