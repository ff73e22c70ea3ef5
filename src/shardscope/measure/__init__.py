"""What a rank holds and sends, measured the same way in a replay (trace, fake tensors) and a real run (runtime):
storages counted once each (`storage`), one tracker of their lives, peak and high water (`tracker`), and one table
from c10d ops to collective ledger rows (`ledger`), so "trace equals run" comes from one implementation. Imports
torch; none of them launches anything."""
