"""STAND-IN for ``torch_npu.contrib`` (NPU rehearsal platform): only ``transfer_to_npu``, imported on demand."""
