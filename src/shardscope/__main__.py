"""`python -m shardscope ...`"""

from shardscope.cli import console_main

console_main()
