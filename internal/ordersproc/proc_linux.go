//go:build linux

package ordersproc

import (
	"os/exec"
	"syscall"
)

// orphanGuard asks the kernel to SIGKILL the service if the test process
// dies first (a -timeout panic runs no t.Cleanup), so that no orders
// process outlives the test.
func orphanGuard(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
