"""The narrow Linear layers: FP8Linear and its plan (fp8), MXLinear (mx)."""
