"""Serving an artifact on NVIDIA Triton Inference Server (Python backend, decoupled).

repository.py writes a model repository; model.py is the file Triton runs (thin); worker.py turns
Triton requests into engine requests and streams the results back; launch.py starts the
`tritonserver` binary that the `nvidia-pytriton` wheel ships (`pip install "snapcompile[triton]"`).
Nothing here imports Triton's own modules: model.py receives them from the Python backend.
"""
