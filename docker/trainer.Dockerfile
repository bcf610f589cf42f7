# syntax=docker/dockerfile:1
# Example trainer for the docker compose stack: CPU MindSpore training the mfotel demo network
# with /metrics on :9464. The same image runs the alert webhook receiver.
#
#   docker build -f docker/trainer.Dockerfile -t mfotel-trainer .    (from the repository root)
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GLOG_v=3

# MindSpore's CPU kernels link against OpenMP (libgomp), which the slim image lacks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/mfotel
COPY pyproject.toml README.md LICENSE ./
COPY mfotel ./mfotel
RUN pip install ".[mindspore]"

RUN useradd --create-home --uid 10001 mfotel
USER mfotel
WORKDIR /home/mfotel

EXPOSE 9464 9095
# About an hour of training (7200 steps, ~0.5 s each): time to watch the dashboards fill.
CMD ["mfotel", "demo", "--host", "0.0.0.0", "--port", "9464", "--steps", "7200", \
     "--step-interval", "1", "--step-sleep", "0.5", "--job-name", "compose-demo", \
     "--linger-seconds", "600"]
