# Replica's image: CPU PyTorch by default; a CUDA PyTorch base makes the GPU image. It installs
# Replica as README does (torch==2.13.0 first, then Replica) and runs the GPT demo by default.
#
#   docker build -t replica .                                  # CPU: python:3.11-slim + torch's CPU wheel
#   docker run --rm replica                                    # the demo (a GPT through a 4-stage pipeline)
#   docker run --rm replica torchrun --nproc-per-node 2 examples/cifar10/train.py --synthetic
#   docker build -t replica:gpu --build-arg BASE=pytorch/pytorch:<a 2.13.0 CUDA runtime tag> .
#   docker run --rm --gpus all --ipc=host replica:gpu torchrun --nproc-per-node 2 examples/gpt/train.py
#
# Only classic Dockerfile syntax (no BuildKit-only features): it builds with the legacy builder too.
ARG BASE=python:3.11-slim
FROM ${BASE}

# torch, unless the base has it: a wheel in docker/wheels/ (git-ignored; docker/test.sh puts the
# host's there), else TORCH_INDEX_URL (PyTorch's CPU wheels: a bare torch is the multi-GB CUDA build;
# empty: PyPI's default)
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=hpo

# Debian's Python refuses pip outside a virtual environment; the base's packages (a CUDA base's
# torch) stay visible through it
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv --system-site-packages /opt/venv

COPY docker/wheels/ /tmp/wheels/
RUN if python -c "import torch" 2>/dev/null; then \
        echo "torch $(python -c 'import torch; print(torch.__version__)') from the base image"; \
    elif ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install --no-cache-dir /tmp/wheels/torch-*.whl; \
    elif [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple "$TORCH"; \
    else \
        pip install --no-cache-dir "$TORCH"; \
    fi && rm -rf /tmp/wheels

WORKDIR /replica
COPY pyproject.toml README.md ./
COPY replica ./replica
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"
COPY examples ./examples

CMD ["python", "examples/gpt/train.py"]
