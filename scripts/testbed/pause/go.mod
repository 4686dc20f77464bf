// The real node's pod sandbox program (scripts/k8s-testbed.sh): no registry is reachable,
// so the pause image is built here.
module gpuflow.local/testbed/pause

go 1.26.0
