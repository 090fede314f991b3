#!/usr/bin/env bash
# Launch a meshforge command on N processes of this machine (the reference's msrun, on torchrun).
#
#   scripts/launch.sh "meshforge train --config configs/qwen3/pretrain_megatron_tiny.yaml" 4
#
# Extra torchrun options go in MESHFORGE_TORCHRUN_ARGS (e.g. "--master-port 29600"). Multi-node
# runs use torchrun's rendezvous directly: see README "Multi-node".
set -euo pipefail

if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
    echo "usage: $0 \"meshforge <command> [args]\" NUM_PROCESSES" >&2
    exit 2
fi
command_line=$1
nproc=$2
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NUM_PROCESSES must be a positive integer, got '$nproc'" >&2
    exit 2
fi

read -r -a words <<<"$command_line"
if [[ "${words[0]}" != "meshforge" ]]; then
    echo "error: the command must start with 'meshforge', got '${words[0]}'" >&2
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${MESHFORGE_PYTHON:-}
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
fi

# shellcheck disable=SC2086
exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" ${MESHFORGE_TORCHRUN_ARGS:-} \
    -m meshforge "${words[@]:1}"
