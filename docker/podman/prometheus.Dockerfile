# Prometheus from Debian's package, for `make compose-check` where prom/prometheus cannot be pulled
# (users get prom/prometheus from docker-compose.yml). BASE_IMAGE: a Debian bookworm image
# (the check passes its local base, docker/podman/base-image.sh). wget serves the compose health check.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# policy-rc.d: the package's postinst must not try to start a service inside a build.
# hadolint ignore=DL3008
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d \
    && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
    && mkdir -p /prometheus \
    && chown 65534:65534 /prometheus

# nobody: the package's own user has no fixed uid.
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
