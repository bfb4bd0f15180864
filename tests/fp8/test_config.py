import pytest

from mixprec.cli import main


@pytest.mark.parametrize("flags, words", [
    (["--fp8.recipe", "foo"], "fp8.recipe: bad value 'foo'; accepted: tensorwise, delayed, rowwise, blockwise"),
    (["--precision.preset", "fp8-rowwise", "--fp8.amax_history_len", "4"], "applies to delayed scaling only"),
    (["--precision.preset", "fp16-mixed", "--fp8.recipe", "rowwise"], "fp8 recipe 'rowwise' on a float16 mode: FP8"),
    (["--precision.preset", "fp8-rowwise", "--fp8.recipe", "delayed"], "contradicts fp8.recipe = 'delayed'"),
])
def test_bad_fp8_config_is_one_line_and_exit_2(tmp_path, capsys, flags, words):
    assert main(["train", "--training.device", "cpu", "--job.dump_folder", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
