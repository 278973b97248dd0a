"""Every model family still computes what it computed when the references were stored
(``tests/reference_outputs.py``): refactors must not move the numbers."""

import os

import numpy as np
import pytest

from reference_outputs import current_outputs, reference_file

# Bit-identical on the machine that stored them; a little room for another
# CPU's instruction set (oneDNN / XLA kernels), far below any real change.
TOLERANCE = 1e-5


@pytest.mark.skipif(not os.path.exists(reference_file()), reason="no stored reference outputs for this backend")
def test_outputs_match_the_stored_references():
    stored = np.load(reference_file())
    outputs = current_outputs()
    assert sorted(stored.files) == sorted(outputs)
    for name, value in outputs.items():
        np.testing.assert_allclose(value, stored[name], atol=TOLERANCE, rtol=0, err_msg=name)
