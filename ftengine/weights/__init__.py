"""Expert weights: checkpoint index, selective safetensors reload, device-layout transforms."""
