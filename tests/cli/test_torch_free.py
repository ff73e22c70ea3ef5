"""The core, the planner and the CLI start without torch (DESIGN.md: a test blocks torch and imports them)."""

import subprocess
import sys

BLOCK_TORCH = """
import sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None
sys.meta_path.insert(0, BlockTorch())
import shardscope.core.memory, shardscope.core.activations, shardscope.cli, shardscope.lesson, shardscope.planner
from shardscope.cli import main
code = main(["estimate", "--model", "llama-3-70b", "--gpus", "64", "--strategy", "all", "--json"])
plan = ["plan", "--model", "llama-3-8b", "--seq-len", "2048", "--max-gpus", "16", "--global-batch-tokens", "256K"]
assert main(plan) == 0
assert code == 0, code
assert "torch" not in sys.modules
print("ok")
"""


def test_core_and_cli_import_without_torch() -> None:
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
