# AdaFlash image: API + UI + engine (`adaflash serve`) or the trainer (`adaflash trainer`).
# CPU by default; for CUDA hosts build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# and, for the SGLang backend, --build-arg EXTRAS=sglang.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    ADAFLASH_DATA=/data \
    ADAFLASH_CACHE=/cache \
    ADAFLASH_HOST=0.0.0.0

WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*
# torch first, from the chosen index, so nothing else pulls a different build
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY adaflash adaflash
COPY lightning_modules lightning_modules
COPY db db
COPY app app
COPY ui ui
COPY workloads workloads
COPY assets assets
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"

VOLUME ["/data", "/cache"]
EXPOSE 8000
CMD ["adaflash", "serve"]
