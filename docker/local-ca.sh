#!/usr/bin/env bash
# A local CA, the two servers' TLS certificates signed by it, and the deployment's secrets: what an
# operator runs to serve HTTPS without a public CA (docs/operating.md, "TLS on every hop").
#
#   docker/local-ca.sh OUT
#
# Writes, keeping whatever exists already (so a second `up` changes nothing):
#   OUT/ca/ca-key.pem                   the CA's key: keep it off the servers (only this script reads it)
#   OUT/ca/ca.pem                       the CA certificate: give it to every client (--ca-file, SFL_CA_FILE)
#   OUT/server/service-secret           the secret the two servers share (--service-secret-file)
#   OUT/server/{fed,main}-server.pem    each server's certificate (--tls-cert) and
#   OUT/server/{fed,main}-server-key.pem  its key (--tls-key)
#   OUT/server/ca.pem                   the CA certificate, for the servers to verify each other
#   OUT/device/enrolment-secret         the shared enrolment secret the devices register with
#   OUT/device/ca.pem                   the CA certificate, for the devices
# Each certificate names its server (fed-server, main-server), localhost and 127.0.0.1, and every
# name or IP address of SFL_TLS_NAMES (comma-separated: the addresses devices outside use, e.g.
# SFL_TLS_NAMES=fed.example.org,192.168.1.20); a certificate whose names changed is issued again.
# Secrets and keys are 0600, certificates 0644, OUT/device 0711 (a scraper running as another user
# reads the CA certificate in it, not the secret). SFL_PKI_GROUP_READABLE=1 makes OUT/server 0750 and
# the keys and secrets 0640 instead, readable by the operator's group: for containers that run as
# another user and get that group (`group_add` in docker-compose.yml); without it, 0700 and 0600
# again. Needs bash and openssl.
set -euo pipefail

out=${1:?usage: local-ca.sh OUT}
days_ca=3650
days_server=825
umask 077
mkdir -p "$out/ca" "$out/server" "$out/device"
chmod 0700 "$out/ca" "$out/server"
chmod 0711 "$out/device"

say() { echo "local-ca: $*" >&2; }

secret() {   # a new random secret in $1 unless it is there
    if [ ! -s "$1" ]; then
        openssl rand -hex 32 > "$1.new" && mv "$1.new" "$1"
        say "wrote $1"
    fi
}

public() {   # copy $1 to $2, readable by everyone (a certificate)
    cp "$1" "$2.new" && chmod 0644 "$2.new" && mv "$2.new" "$2"
}

if [ ! -s "$out/ca/ca.pem" ] || [ ! -s "$out/ca/ca-key.pem" ]; then
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$out/ca/ca-key.pem" 2>/dev/null
    openssl req -x509 -new -key "$out/ca/ca-key.pem" -sha256 -days "$days_ca" -subj "/CN=S2FL local CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$out/ca/ca.pem.new"
    chmod 0644 "$out/ca/ca.pem.new" && mv "$out/ca/ca.pem.new" "$out/ca/ca.pem"
    rm -f "$out"/server/*-server.pem   # certificates of another CA
    say "made a CA: $out/ca/ca.pem"
fi
public "$out/ca/ca.pem" "$out/server/ca.pem"
public "$out/ca/ca.pem" "$out/device/ca.pem"

extra=${SFL_TLS_NAMES:-}
for name in fed-server main-server; do
    sans="DNS:$name,DNS:localhost,IP:127.0.0.1"
    IFS=',' read -ra more <<< "$extra"
    for n in "${more[@]}"; do
        n=${n// /}
        [ -z "$n" ] && continue
        if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then sans="$sans,IP:$n"; else sans="$sans,DNS:$n"; fi
    done
    cert="$out/server/$name.pem" key="$out/server/$name-key.pem" names="$out/server/$name.names"
    if [ -s "$cert" ] && [ -s "$key" ] && [ "$(cat "$names" 2>/dev/null)" = "$sans" ]; then
        continue
    fi
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$key" 2>/dev/null
    openssl req -new -key "$key" -subj "/CN=$name" -out "$out/server/$name.csr"
    printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' \
        "$sans" > "$out/server/$name.ext"
    openssl x509 -req -in "$out/server/$name.csr" -CA "$out/ca/ca.pem" -CAkey "$out/ca/ca-key.pem" \
        -set_serial "0x$(openssl rand -hex 16)" -days "$days_server" -sha256 -extfile "$out/server/$name.ext" \
        -out "$cert.new" 2>/dev/null
    chmod 0644 "$cert.new" && mv "$cert.new" "$cert"
    rm -f "$out/server/$name.csr" "$out/server/$name.ext"
    echo "$sans" > "$names"
    say "issued $cert for $sans"
done

secret "$out/server/service-secret"
secret "$out/device/enrolment-secret"
cp "$out/device/enrolment-secret" "$out/server/enrolment-secret.new" && mv "$out/server/enrolment-secret.new" "$out/server/enrolment-secret"
# Group-readable only when asked (the compose file's containers run as uid 10001, not as the operator).
if [ "${SFL_PKI_GROUP_READABLE:-0}" = 1 ]; then dir_mode=0750 file_mode=0640; else dir_mode=0700 file_mode=0600; fi
chmod "$dir_mode" "$out/server"
chmod "$file_mode" "$out"/server/*-key.pem "$out/server/service-secret" "$out/server/enrolment-secret" \
    "$out/device/enrolment-secret"
say "ready in $out"
