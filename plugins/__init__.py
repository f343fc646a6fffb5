"""Custom ops for the plugin lowering (installed as snapcompile.plugins).

- contracts: the two ops' names, inputs, outputs and attributes.
- reference: their PyTorch reference implementations (shared with the reference policy).
- triton_kernels: the fused decode-attention Triton kernel.
- ort_ops: ONNX Runtime implementations (onnxruntime-extensions), so plugin-lowered graphs run on CPU.
- trt_plugin: the TensorRT plugin registration (tensorrt.plugin), imported lazily.
"""
