#!/usr/bin/env bash
# Runs once, when the postgres container initializes an EMPTY data volume
# (/docker-entrypoint-initdb.d). Creates one role and one database for Optuna and one for
# MLflow, with passwords from the environment (see .env.example). Changing a password in .env
# later does NOT change it here: use ALTER ROLE ... PASSWORD, or remove the volume.
set -euo pipefail

: "${OPTUNA_DB_USER:?}" "${OPTUNA_DB_PASSWORD:?}" "${OPTUNA_DB_NAME:?}"
: "${MLFLOW_DB_USER:?}" "${MLFLOW_DB_PASSWORD:?}" "${MLFLOW_DB_NAME:?}"

# psql variables (:"ident", :'literal') quote names and passwords, so any characters are safe.
# The password is read from the environment (\getenv, psql 15+), not given on psql's command
# line, which `ps` shows on the host while the first start runs.
create() {
  INIT_DB_PASSWORD="$2" psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" \
    --dbname postgres -v user="$1" -v db="$3" <<'SQL'
\getenv pass INIT_DB_PASSWORD
CREATE ROLE :"user" LOGIN PASSWORD :'pass';
CREATE DATABASE :"db" OWNER :"user";
REVOKE ALL ON DATABASE :"db" FROM PUBLIC;
SQL
}

create "$OPTUNA_DB_USER" "$OPTUNA_DB_PASSWORD" "$OPTUNA_DB_NAME"
create "$MLFLOW_DB_USER" "$MLFLOW_DB_PASSWORD" "$MLFLOW_DB_NAME"
echo "init-databases: created ${OPTUNA_DB_NAME} (owner ${OPTUNA_DB_USER}) and ${MLFLOW_DB_NAME} (owner ${MLFLOW_DB_USER})"
