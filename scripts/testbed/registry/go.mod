// Builds the tests' local OCI registry (scripts/registry.sh).
module gpuflow.local/testbed/registry

go 1.26.0

require github.com/google/go-containerregistry v0.22.1
