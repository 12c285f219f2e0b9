"""The NPU rehearsal platform: a declared stand-in for what only an Ascend NPU provides, so the
Ascend path (MindSpeed, MindSpeed-LLM, their torch_npu operators) assembles and trains on the host.
Used only when that platform is selected explicitly, never where the real torch_npu imports; it
proves the Python integration and the operators' math as documented, not the NPU's kernels.
"""
