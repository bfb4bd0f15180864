"""The diagnosis: the health rules of the seed's NumericalStabilityMonitor (loss
explosion, gradient explosion or vanishing, NaN frequency), applied at an incident and
written as one paragraph naming the likely cause and what was done."""

from __future__ import annotations

import math

from mixprec.stability.locate import Finding


def diagnose(kind: str, reason: str, loss: float, grad_norm: float | None, recent_norms: list[float],
             nonfinite_recent: int, window: int, finding: Finding | None, action: str) -> str:
    """One readable paragraph. `nonfinite_recent`: non-finite incidents among the last
    `window` steps, this one included."""
    causes = []
    if kind == "nonfinite" and not math.isfinite(loss):
        causes.append(f"the loss is {loss}")
    if finding is not None:
        causes.append(f"the first non-finite value appears in {finding}")
        if finding.max_abs_input > finding.dtype_max / 256:
            causes.append(f"{finding.dtype} ends at {finding.dtype_max:g} and its inputs were within a factor 256 of "
                          f"that: an overflow in {finding.dtype} is the likely cause (bf16 has float32's range; or keep "
                          "this module in float32)")
        else:
            causes.append("its inputs were finite, so it made the value itself")
    elif kind == "nonfinite":
        causes.append("the locator's re-run stayed finite (the cause did not repeat: a transient fault, or "
                      "state the re-run does not reproduce)")
    if kind == "loss_spike" or (math.isfinite(loss) and loss > 1e6):
        causes.append(f"loss explosion ({reason}): most often a learning rate too high for this point of training, "
                      "or a corrupted batch")
    if grad_norm is not None and math.isfinite(grad_norm) and grad_norm > 100:
        causes.append(f"gradient explosion (norm {grad_norm:.3g}): gradient clipping (training.max_norm) bounds the update it "
                      "would make")
    if len(recent_norms) >= 10 and all(n < 1e-6 for n in recent_norms[-10:]):
        causes.append("gradients have vanished (the last 10 norms are below 1e-6): too deep a network without "
                      "normalisation, saturated activations, or underflow in a narrow format")
    if nonfinite_recent > 1:
        causes.append(f"non-finite values in {nonfinite_recent} of the last {window} steps: recurring, so check "
                      "the data, the loss and the precision of the module named above")
    text = "; ".join(causes) if causes else reason
    return f"Diagnosis: {text[0].upper()}{text[1:]}. Action: {action}."
