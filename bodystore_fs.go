package idem

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// DirBodyStore is a [BodyStore] in a directory of the local filesystem,
// for a service that runs on one machine (or shares the directory over a
// filesystem with POSIX rename and fsync semantics). Each object is one
// file, named by idem's name for it and the SHA-256 of its content
// ("<name>.<sha256>"), written to a temporary file, fsynced, renamed into
// place and made durable by an fsync of the directory before Put returns.
// A crash during Put leaves at most a temporary file (".tmp-*"), which List
// does not report and RemoveTemp deletes.
type DirBodyStore struct {
	dir string
}

// NewDirBodyStore returns a DirBodyStore over dir, creating it (mode 0700)
// if it does not exist.
func NewDirBodyStore(dir string) (*DirBodyStore, error) {
	if dir == "" {
		return nil, errors.New("idem: NewDirBodyStore needs a directory")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("idem: body store directory: %w", err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("idem: body store directory: %w", err)
	}
	return &DirBodyStore{dir: abs}, nil
}

// Dir returns the store's directory.
func (d *DirBodyStore) Dir() string { return d.dir }

const tmpPrefix = ".tmp-"

// path maps an address to its file, refusing anything that is not a plain
// file name of this store (an address read from a damaged record must not
// reach outside the directory).
func (d *DirBodyStore) path(address string) (string, error) {
	if !validAddress(address) || strings.ContainsAny(address, `/\`) || strings.HasPrefix(address, ".") {
		return "", fmt.Errorf("idem: not an address of a DirBodyStore: %w", fs.ErrNotExist)
	}
	return filepath.Join(d.dir, address), nil
}

// Put implements [BodyStore].
func (d *DirBodyStore) Put(ctx context.Context, name string, r io.Reader) (string, error) {
	if !validAddress(name) || strings.ContainsAny(name, `/\.`) {
		return "", errors.New("idem: invalid object name")
	}
	f, err := os.CreateTemp(d.dir, tmpPrefix+name+"-*")
	if err != nil {
		return "", err
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(f, h), ctxReader{ctx, r}); err != nil {
		return "", err
	}
	if err := f.Sync(); err != nil {
		return "", err
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	addr := name + "." + hex.EncodeToString(h.Sum(nil))
	if err := os.Rename(tmp, filepath.Join(d.dir, addr)); err != nil {
		return "", err
	}
	ok = true
	if err := syncDir(d.dir); err != nil {
		// The rename may not survive a crash: remove it so that no record
		// names an object that could vanish.
		_ = os.Remove(filepath.Join(d.dir, addr))
		return "", err
	}
	return addr, nil
}

// Open implements [BodyStore].
func (d *DirBodyStore) Open(ctx context.Context, address string) (io.ReadCloser, error) {
	p, err := d.path(address)
	if err != nil {
		return nil, err
	}
	return os.Open(p)
}

// Delete implements [BodyStore].
func (d *DirBodyStore) Delete(ctx context.Context, address string) error {
	p, err := d.path(address)
	if err != nil {
		return nil
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// List implements [BodyStore]; the time is the file's modification time.
func (d *DirBodyStore) List(ctx context.Context, writtenBefore time.Time, fn func(address string) error) error {
	entries, err := os.ReadDir(d.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return err
		}
		if !e.Type().IsRegular() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		info, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		if info.ModTime().Before(writtenBefore) {
			if err := fn(e.Name()); err != nil {
				return err
			}
		}
	}
	return nil
}

// RemoveTemp deletes temporary files of Puts that crashed, last written
// before the given time, and returns how many it deleted.
func (d *DirBodyStore) RemoveTemp(writtenBefore time.Time) (int, error) {
	entries, err := os.ReadDir(d.dir)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), tmpPrefix) {
			continue
		}
		info, err := e.Info()
		if err != nil || !info.ModTime().Before(writtenBefore) {
			continue
		}
		if err := os.Remove(filepath.Join(d.dir, e.Name())); err == nil {
			n++
		}
	}
	return n, nil
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// ctxReader stops a copy when ctx ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
