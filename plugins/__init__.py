"""Custom ops for the plugin lowering (installed as snapcompile.plugins).

- contracts: the two ops' names, inputs, outputs and attributes (read by everything below).
- torch_ops: their PyTorch implementations (the functions of snapcompile.reference.policy).
- triton_kernels: the fused decode-attention and window-score Triton kernels.
- ort_ops: ONNX Runtime implementations (onnxruntime-extensions), so plugin-lowered graphs run on CPU.
- trt_plugin: the TensorRT plugin registration (tensorrt.plugin), imported lazily.
"""
