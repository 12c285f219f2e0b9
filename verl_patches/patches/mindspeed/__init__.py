"""Patches of MindSpeed (Ascend only): one module per MindSpeed module patched."""
