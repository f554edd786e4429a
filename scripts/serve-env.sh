# Exports a serving environment file (KEY=VALUE lines; default deploy/serve.env), keeping any
# variable that is already set. Source it before `serve run` or `ray start` (docs/serving.md):
#   source scripts/serve-env.sh && .venv/bin/serve run deploy/serve.yaml
#   source scripts/serve-env.sh deploy/serve-cluster.env && .venv/bin/ray start --head    # every node
_rayllm_env_file="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/deploy/serve.env}"
while IFS='=' read -r _rayllm_key _rayllm_value; do
    case "$_rayllm_key" in ''|'#'*) continue ;; esac
    if [ -z "${!_rayllm_key+x}" ]; then
        export "$_rayllm_key=$_rayllm_value"
    fi
done < "$_rayllm_env_file"
unset _rayllm_env_file _rayllm_key _rayllm_value
