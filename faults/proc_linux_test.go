//go:build faults && linux

package faults

import (
	"os/exec"
	"syscall"
)

// procOrphanGuard asks the kernel to SIGKILL the service if the test
// process dies first (a -timeout panic runs no t.Cleanup), so that no
// orders process outlives the suite.
func procOrphanGuard(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
