"""Teaching strategies written from collectives: ddp (naive, bucketed), zero1, zero2, zero3/fsdp and hsdp."""
