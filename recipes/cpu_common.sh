# Shared by the CPU recipes' run.sh (sourced after PYTHON and RUN_DIR are set, with the recipe's Hydra overrides
# as arguments): where the tiny model goes and its shape, and the environment a small machine needs.

# The tiny model's shape fits the rollout the overrides select: vLLM's CPU attention serves head sizes 32, 64, 80, ...
# only (verl_mas.backends.vllm.support), not the default tiny model's 16 (hidden 64 over 4 heads), so a vLLM rollout
# gets hidden 128 (head size 32), in a directory of its own: a model built for the hf rollout is never reused.
ROLLOUT=hf
CLUSTER=
TP=1
for arg in "$@"; do
  case "$arg" in
    cpu_rollout=*|+cpu_rollout=*|++cpu_rollout=*) ROLLOUT="${arg#*cpu_rollout=}" ;;
    actor_rollout_ref.rollout.name=*|+actor_rollout_ref.rollout.name=*|++actor_rollout_ref.rollout.name=*) ROLLOUT="${arg#*=}" ;;
    actor_rollout_ref.rollout.tensor_model_parallel_size=*) TP="${arg#*=}" ;;
    ray_kwargs.ray_init.address=*) [ "${arg#*=}" = local ] || CLUSTER=1 ;;
  esac
done
# vLLM's CPU build binds each tensor-parallel worker's OpenMP threads to a NUMA node of its own by default and refuses
# more workers than nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"): with tensor
# parallel > 1 on a machine of fewer nodes, let the operating system place the threads (or set your own binding,
# e.g. VLLM_CPU_OMP_THREADS_BIND='0|1').
if [ "$ROLLOUT" = vllm ] && [ "$TP" != 1 ] && [ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" ]; then
  export VLLM_CPU_OMP_THREADS_BIND=nobind
fi
MODEL="$RUN_DIR/model"; SHAPE=()
if [ "$ROLLOUT" = vllm ]; then MODEL="$RUN_DIR/model-h128"; SHAPE=(--hidden-size 128); fi

export VERL_PLATFORM=cpu
# TransferQueue's threads: one per physical core (its default of 8 warns hundreds of times on a small machine).
export TQ_NUM_THREADS="${TQ_NUM_THREADS:-$("$PYTHON" -c 'import psutil; print(psutil.cpu_count(logical=False) or 1)')}"
# verl's engine registry warns in every process that the engines of other frameworks are not installed.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning:verl.workers.engine}"
# A Ray of its own (ray_kwargs.ray_init.address=local in the yaml), which RAY_ADDRESS would override; to train on a
# cluster, pass ray_kwargs.ray_init.address=<head:port>.
unset RAY_ADDRESS

# ray_env (called once the recipe has exported VERL_FILE_LOGGER_PATH): on a cluster, RAY_ENV holds the overrides
# that carry the environment above and the logger's path to every Ray worker in Ray's runtime environment (a local
# Ray's workers inherit this shell's environment; a cluster's raylets were started with their own), and that leave
# the cluster's CPU and GPU counts to it (ray.init refuses them when joining a cluster).
ray_env() {
  [ -n "$CLUSTER" ] || return 0
  RAY_ENV=(ray_kwargs.ray_init.num_cpus=null ray_kwargs.ray_init.num_gpus=null)
  for name in VERL_PLATFORM TQ_NUM_THREADS PYTHONWARNINGS VERL_FILE_LOGGER_PATH VLLM_CPU_OMP_THREADS_BIND; do
    if [ -n "${!name:-}" ]; then RAY_ENV+=("+ray_kwargs.ray_init.runtime_env.env_vars.$name='${!name}'"); fi
  done
}
RAY_ENV=()
