#!/bin/sh
# The official postgres image's contract, as far as docker/compose.replicas.yaml uses it: at the
# first start (an empty $PGDATA) a cluster whose superuser is $POSTGRES_USER with the password
# $POSTGRES_PASSWORD and a database $POSTGRES_DB; then the server on every interface, password
# (SCRAM) logins from the network, trusted logins on the container's own socket (pg_isready, psql).
set -eu
mkdir -p "$PGDATA" /run/postgresql
chown postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
as_postgres="setpriv --reuid=postgres --regid=postgres --init-groups"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}" > "$pwfile"
    chown postgres "$pwfile"
    # UTF-8 as in the official image (a SQL_ASCII database hands psycopg bytes, not text)
    $as_postgres initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" \
        --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 > /dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    # single-user mode runs as the bootstrap superuser, with no server listening yet
    echo "CREATE DATABASE \"${POSTGRES_DB:-$POSTGRES_USER}\" OWNER \"$POSTGRES_USER\";" \
        | $as_postgres postgres --single -D "$PGDATA" postgres > /dev/null
fi
exec $as_postgres postgres -D "$PGDATA" -c listen_addresses='*'
