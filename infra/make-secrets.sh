#!/bin/sh
# Create the credentials infra/compose.yaml reads as docker secrets, once: random, one per file,
# readable by the owner only, in infra/secrets/ (ignored by git). An existing file is kept, so running
# this again never rotates a password a server already stored (Postgres and MLflow keep theirs in
# their volumes).
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
mkdir -p "$dir"
chmod 700 "$dir"
umask 077
rand() { od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }
for name in postgres_password minio_root_password mlflow_admin_password mlflow_flask_secret_key vllm_api_key; do
    [ -s "$dir/$name" ] || rand > "$dir/$name"
done
# Prefect's basic auth is one "user:password" string, the same on the server and every client.
[ -s "$dir/prefect_auth_string" ] || printf 'flywheel:%s' "$(rand)" > "$dir/prefect_auth_string"
echo "secrets in $dir"
