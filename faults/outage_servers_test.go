//go:build faults

package faults

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
)

// The outage scenario stops and crashes database servers, which it must not
// do to the shared servers other tests use: it runs private PostgreSQL and
// MariaDB instances, each in a temporary directory, on a free port bound to
// 127.0.0.1, and removes them when the test ends. The server runs in a
// process group of its own, so a crash (SIGKILL to the group) takes down
// every PostgreSQL backend at once, as a machine or container failure would,
// and the next start on the same data directory runs crash recovery.

const (
	outagePGBin    = "/usr/lib/postgresql/15/bin"
	outageMariaDBD = "/usr/sbin/mariadbd"
	outageMariaDBI = "mariadb-install-db"
	// outageReadyTimeout bounds a server's start-up; both start in about
	// a second here.
	outageReadyTimeout = 30 * time.Second
)

// outageServer is one database server process owned by a test.
type outageServer struct {
	t    *testing.T
	name string // for messages
	dir  string
	port int
	// command builds the server's command line, the same at every start.
	command func() *exec.Cmd
	// ready checks that the server accepts connections.
	ready func(ctx context.Context) error
	cred  *syscall.Credential

	cmd    *exec.Cmd
	exited chan struct{}
	log    string
}

// start starts the server and waits until it accepts connections, failing
// the test with the end of its log if it does not.
func (s *outageServer) start() {
	s.t.Helper()
	if s.cmd != nil {
		s.t.Fatalf("%s: start while running", s.name)
	}
	logf, err := os.OpenFile(s.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatalf("%s: log: %v", s.name, err)
	}
	defer logf.Close()
	cmd := s.command()
	cmd.Dir = s.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	// Pdeathsig: a test binary killed by a timeout takes its servers with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL, Credential: s.cred}
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("%s: start %s: %v", s.name, cmd.Path, err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	s.cmd, s.exited = cmd, exited

	deadline := time.Now().Add(outageReadyTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := s.ready(ctx)
		cancel()
		if err == nil {
			return
		}
		select {
		case <-exited:
			s.cmd = nil
			s.t.Fatalf("%s exited during start-up (%v); its log ends:\n%s", s.name, err, s.logTail())
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s did not accept connections within %s (%v); its log ends:\n%s", s.name, outageReadyTimeout, err, s.logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stop sends sig to the server process (a clean shutdown: SIGINT for
// PostgreSQL's fast shutdown, SIGTERM for MariaDB) and waits until every
// process of its group is gone.
func (s *outageServer) stop(sig syscall.Signal) {
	s.t.Helper()
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("%s: signal %v: %v", s.name, sig, err)
	}
	s.waitGone(fmt.Sprintf("stop (%v)", sig))
}

// crash kills every process of the server's group with SIGKILL.
func (s *outageServer) crash() {
	s.t.Helper()
	if err := syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL); err != nil {
		s.t.Fatalf("%s: kill -9: %v", s.name, err)
	}
	s.waitGone("kill -9")
}

func (s *outageServer) waitGone(what string) {
	s.t.Helper()
	pgid := s.cmd.Process.Pid
	select {
	case <-s.exited:
	case <-time.After(outageReadyTimeout):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		s.t.Fatalf("%s did not exit within %s of %s; killed", s.name, outageReadyTimeout, what)
	}
	s.cmd = nil
	// PostgreSQL's backends leave after the postmaster; a new postmaster
	// refuses to start while they hold the old shared memory.
	for deadline := time.Now().Add(outageReadyTimeout); syscall.Kill(-pgid, 0) == nil; {
		if time.Now().After(deadline) {
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
			s.t.Fatalf("%s: processes of group %d still alive %s after %s", s.name, pgid, outageReadyTimeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// cleanup kills the server if it runs and removes its directory.
func (s *outageServer) cleanup() {
	if s.cmd != nil {
		pgid := s.cmd.Process.Pid
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		select {
		case <-s.exited:
		case <-time.After(outageReadyTimeout):
			s.t.Errorf("%s: process %d survived SIGKILL", s.name, pgid)
		}
		for deadline := time.Now().Add(5 * time.Second); syscall.Kill(-pgid, 0) == nil && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
		s.cmd = nil
	}
	if err := os.RemoveAll(s.dir); err != nil {
		s.t.Errorf("%s: remove %s: %v", s.name, s.dir, err)
	}
}

func (s *outageServer) logTail() string {
	b, _ := os.ReadFile(s.log)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-20):], "\n")
}

// outageFreePort returns a TCP port free on 127.0.0.1 right now. The server
// keeps it across restarts; another process could take it between the
// probe and the first start, which is unlikely enough on a test machine.
func outageFreePort(t *testing.T) int {
	t.Helper()
	ln, err := (&net.ListenConfig{}).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// outageTempDir makes a temporary directory outside t.TempDir, whose
// parents are private to root where the postgres user cannot reach them.
// The server's cleanup removes it once the server is gone.
func outageTempDir(t *testing.T, pattern string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", pattern) //nolint:usetesting // t.TempDir's parents are private to root; the postgres user must reach this one
	if err != nil {
		t.Fatalf("temporary directory: %v", err)
	}
	return dir
}

// outageStartPostgres initialises and starts a private PostgreSQL 15 as the
// postgres OS user (initdb and postgres refuse to run as root), with trust
// authentication. fsync is off: the faults are process crashes, after which
// the kernel still holds every write; only a power loss would need fsync.
func outageStartPostgres(t *testing.T) (*outageServer, string) {
	t.Helper()
	u, err := user.Lookup("postgres")
	if err != nil {
		t.Fatalf("private PostgreSQL: the postgres OS user is needed to run initdb and postgres: %v", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		t.Fatalf("private PostgreSQL: user postgres: %v", err)
	}
	dir := outageTempDir(t, "idem-outage-pg-")
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}
	s := &outageServer{t: t, name: "private PostgreSQL", dir: dir, port: outageFreePort(t), cred: cred, log: filepath.Join(dir, "server.log")}
	t.Cleanup(s.cleanup)
	if err := os.Chown(dir, int(uid), int(gid)); err != nil {
		t.Fatalf("private PostgreSQL: chown %s: %v", dir, err)
	}
	data := filepath.Join(dir, "data")
	initdb := exec.CommandContext(t.Context(), filepath.Join(outagePGBin, "initdb"),
		"-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync")
	initdb.Dir = dir
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("private PostgreSQL: initdb: %v\n%s", err, out)
	}
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
	s.command = func() *exec.Cmd {
		//nolint:noctx // the server outlives any one context: the test stops and kills it on purpose, and in t.Cleanup
		return exec.Command(filepath.Join(outagePGBin, "postgres"), "-D", data, "-p", strconv.Itoa(s.port), "-k", dir,
			"-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "shared_buffers=16MB", "-c", "max_connections=40")
	}
	s.ready = func(ctx context.Context) error {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		return conn.Ping(ctx)
	}
	s.start()
	return s, url
}

// outageStartMariaDB initialises and starts a private MariaDB, as root,
// with no option files read, whose root user needs no password from
// 127.0.0.1. The small buffer pool keeps start-up fast.
func outageStartMariaDB(t *testing.T) (*outageServer, string) {
	t.Helper()
	dir := outageTempDir(t, "idem-outage-mariadb-")
	s := &outageServer{t: t, name: "private MariaDB", dir: dir, port: outageFreePort(t), log: filepath.Join(dir, "server.log")}
	t.Cleanup(s.cleanup)
	data := filepath.Join(dir, "data")
	install := exec.CommandContext(t.Context(), outageMariaDBI, "--no-defaults", "--datadir="+data, "--user=root",
		"--auth-root-authentication-method=normal", "--skip-test-db")
	install.Dir = dir
	if out, err := install.CombinedOutput(); err != nil {
		t.Fatalf("private MariaDB: %s: %v\n%s", outageMariaDBI, err, out)
	}
	dsn := fmt.Sprintf("root@tcp(127.0.0.1:%d)/?parseTime=true", s.port)
	s.command = func() *exec.Cmd {
		//nolint:noctx // the server outlives any one context: the test stops and kills it on purpose, and in t.Cleanup
		return exec.Command(outageMariaDBD, "--no-defaults", "--datadir="+data, "--port="+strconv.Itoa(s.port),
			"--bind-address=127.0.0.1", "--socket="+filepath.Join(dir, "mysqld.sock"), "--pid-file="+filepath.Join(dir, "mysqld.pid"),
			"--user=root", "--skip-name-resolve", "--skip-log-bin", "--innodb-buffer-pool-size=16M", "--log-error="+s.log)
	}
	s.ready = func(ctx context.Context) error {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return err
		}
		conn, err := gomysql.NewConnector(cfg)
		if err != nil {
			return err
		}
		db := sql.OpenDB(conn)
		defer db.Close()
		return db.PingContext(ctx)
	}
	s.start()
	return s, dsn
}
