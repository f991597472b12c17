# Sourced at the start of a command on a lent GPU machine (see DEVELOPERS.md, "The CUDA path"): its image has
# torch, triton and transformers but not all of graphmesh's dependencies, which travel as wheels in .whl/
# (carry: [".whl"]); graphmesh itself runs from the working tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="/tmp/site:$PWD/clients/python:$PWD/services/common:$PWD/services/executor:$PWD/services/coordinator:$PWD/services/kvstore:$PWD"
export PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c 'import torch, grpc, google.protobuf as pb; print("torch", torch.__version__, torch.cuda.get_device_name(0), "grpc", grpc.__version__, "protobuf", pb.__version__)'
