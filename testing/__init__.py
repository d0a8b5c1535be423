"""What the tests and the benchmarks both use, and neither owns: servers on loopback
(:mod:`.moto_server`, S3/Batch/CloudWatch Logs; :mod:`.loopback`, the way such a server is started)
and generated Criteo click logs (:mod:`.criteo_files`). The tests import from here, and so do the
benchmarks, which never import the tests."""
