import pytest

from mixprec.cli import main


@pytest.mark.parametrize("flags, words", [
    (["--fp8.recipe", "foo"], "fp8.recipe: bad value 'foo'; accepted: tensorwise, delayed, rowwise, blockwise, mxfp8, nvfp4, mxfp4"),
    (["--precision.preset", "fp8-rowwise", "--fp8.amax_history_len", "4"], "applies to delayed scaling only"),
    (["--precision.preset", "fp16-mixed", "--fp8.recipe", "rowwise"], "fp8 recipe 'rowwise' on a float16 mode: FP8"),
    (["--precision.preset", "fp8-rowwise", "--fp8.recipe", "delayed"], "contradicts fp8.recipe = 'delayed'"),
    (["--precision.preset", "nvfp4", "--fp8.hadamard", "walsh"],
     "fp8.hadamard: bad value 'walsh'; accepted: none, random, deterministic (or empty: the recipe's)"),
    (["--precision.preset", "fp8-rowwise", "--fp8.hadamard", "random"], "applies to the microscaled recipes only"),
    (["--precision.preset", "mxfp8", "--fp8.weight_2d", "true"], "(2-D weight blocks and 4-over-6 are NVFP4 options)"),
    (["--precision.preset", "mxfp8", "--fp8.stochastic_gradients", "true"], "are FP4 options"),
    (["--precision.preset", "nvfp4", "--fp8.margin", "2"], "applies to delayed scaling only"),
    (["--precision.preset", "mxfp4", "--fp8.keep_last_blocks", "1.5"], "fp8.keep_last_blocks: bad value 1.5"),
])
def test_bad_fp8_config_is_one_line_and_exit_2(tmp_path, capsys, flags, words):
    assert main(["train", "--training.device", "cpu", "--job.dump_folder", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
