#!/bin/sh
# Run a command with every NAME_FILE variable of its environment exported as NAME (the file's content,
# trailing newline dropped): the docker-secrets convention (/run/secrets/NAME), for images and tools
# that read only NAME (vLLM's VLLM_API_KEY, Prefect's auth strings, MLflow's admin password, libpq's
# PGPASSWORD). A NAME that is already set is kept. A NAME_FILE that cannot be read stops the start:
# a server must not come up without the credential it was meant to require.
#
#   with-secrets.sh COMMAND [ARGS...]
set -eu
for pair in $(env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)_FILE=.*/\1/p'); do
    name="$pair"
    eval "file=\${${name}_FILE}"
    eval "already=\${${name}+set}"
    if [ "$already" = "set" ]; then
        continue
    fi
    if [ ! -r "$file" ]; then
        echo "with-secrets.sh: ${name}_FILE=$file cannot be read; not starting" >&2
        exit 1
    fi
    value="$(cat "$file")"
    export "$name=$value"
done
exec "$@"
