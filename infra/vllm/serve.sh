#!/usr/bin/env bash
# Serve a flywheel-exported policy with vLLM (in vLLM's own environment; see README.md).
#
#   infra/vllm/serve.sh MODEL_DIR [ADAPTER_DIR] [-- extra vllm args]
#
# MODEL_DIR    merged safetensors directory (config.json + *.safetensors + tokenizer), e.g.
#              $FLYWHEEL_HOME/models/base/smollm2-135m or a registered model's local dir
# ADAPTER_DIR  optional peft LoRA adapter directory, served as model "policy-lora"
# Environment: VLLM_VENV (default ./.venv-vllm), HOST (127.0.0.1), PORT (8001),
#              SERVED_NAME (policy), MAX_LORA_RANK (64), VLLM_API_KEY (required off loopback).
set -euo pipefail

model_dir=${1:?usage: serve.sh MODEL_DIR [ADAPTER_DIR] [-- extra vllm args]}
shift
adapter_dir=""
if [[ $# -gt 0 && $1 != "--" ]]; then adapter_dir=$1; shift; fi
[[ ${1:-} == "--" ]] && shift

venv=${VLLM_VENV:-.venv-vllm}
host=${HOST:-127.0.0.1}
port=${PORT:-8001}
name=${SERVED_NAME:-policy}

[[ -f $model_dir/config.json ]] || { echo "error: $model_dir has no config.json" >&2; exit 2; }
if [[ $host != 127.0.0.1 && $host != localhost && $host != ::1 && -z ${VLLM_API_KEY:-} ]]; then
  echo "error: binding $host needs VLLM_API_KEY (the same rule as flywheel serve)" >&2; exit 2
fi

args=(serve "$model_dir" --served-model-name "$name" --host "$host" --port "$port"
      --dtype auto)
if [[ -n $adapter_dir ]]; then
  [[ -f $adapter_dir/adapter_config.json ]] || { echo "error: $adapter_dir is not a peft adapter" >&2; exit 2; }
  args+=(--enable-lora --max-lora-rank "${MAX_LORA_RANK:-64}" --lora-modules "$name-lora=$adapter_dir")
fi
# Runtime /v1/load_lora_adapter and /v1/unload_lora_adapter (OpenAIPolicy.load_lora_adapter):
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
export HF_HUB_OFFLINE=1
exec "$venv/bin/vllm" "${args[@]}" "$@"
