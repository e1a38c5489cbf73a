//! Faults of the target, of lens-probe itself and overload (issue 7, items 1–3): each
//! fault and the behaviour observed, asserted.
