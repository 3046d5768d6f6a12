"""The README's quick example runs and learns what it claims."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_fifteen_line_example(capsys):
    text = README.read_text()
    code = re.search(r"## Fifteen lines\n\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 16
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    w = namespace["step"].unreplicate(namespace["state"]).params["w"].ravel()
    np.testing.assert_allclose(w, [1.0, 2.0, 3.0], atol=1e-2)
    assert capsys.readouterr().out.strip()
