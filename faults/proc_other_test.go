//go:build faults && !linux

package faults

import "os/exec"

// procOrphanGuard does nothing here: only Linux can tie a child's life to
// its parent's. t.Cleanup still kills the service when a test ends.
func procOrphanGuard(*exec.Cmd) {}
