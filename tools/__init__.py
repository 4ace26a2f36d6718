"""What both the tests and the benchmarks use, kept out of both so neither imports the other:
files in each dataset's public format (``sample_files``), LLaDA's and SDAR's decoders written out as
a reference (``llada_reference``), a loopback S3 server (``loopback_s3``) and the prepared check for
a lent GPU (``gpu_check``, run through ``benchmarks/gpu_check.sh``). None of it is product code."""
