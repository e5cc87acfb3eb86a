package idems3_test

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/conformance"
	"github.com/idemstore/idem/contrib/idems3"
	"github.com/idemstore/idem/internal/testdb"
)

// The conformance suite's body-store cases with the S3 store: round trip,
// server down (a closed port: ErrBodyUnavailable, nothing committed, the
// key free), orphans swept, objects deleted or damaged by hand
// (ErrCorruptRecord), the reaper, leased completions and verdicts.
func TestConformanceSQLite(t *testing.T) {
	t.Parallel()
	conformance.RunBodyStore(t, sqliteHarness{}, s3Stores{s3Server(t)})
}

func TestConformancePostgres(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	conformance.RunBodyStore(t, pgHarness{testdb.PostgresURL(t)}, s3Stores{srv})
}

func TestConformanceMariaDB(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	conformance.RunBodyStore(t, newMySQLHarness(t), s3Stores{srv})
}

// TestLargeBodySQLite and TestLargeBodyPostgres store a 50 MiB body in S3
// (a multipart upload) and replay it byte for byte with the live heap far
// below its size. Not parallel: the heap measured is the process's.
func TestLargeBodySQLite(t *testing.T) {
	conformance.RunLargeBodyStore(t, sqliteHarness{}, s3Stores{s3Server(t)})
}

func TestLargeBodyPostgres(t *testing.T) {
	srv := s3Server(t)
	conformance.RunLargeBodyStore(t, pgHarness{testdb.PostgresURL(t)}, s3Stores{srv})
}

func newStore(t *testing.T, srv server, prefix string) *idems3.Store {
	t.Helper()
	st, err := idems3.New(idems3.Config{Client: srv.client(srv.endpoint), Bucket: srv.bucket, Prefix: prefix})
	require.NoError(t, err)
	t.Cleanup(func() { removePrefix(t, srv.client(srv.endpoint), srv.bucket, prefix) })
	return st
}

func list(t *testing.T, st idem.BodyStore, before time.Time) []string {
	t.Helper()
	var out []string
	require.NoError(t, st.List(t.Context(), before, func(a string) error {
		out = append(out, a)
		return nil
	}))
	return out
}

// TestContract checks the BodyStore contract clause by clause on the
// server: Put's address, Open's bytes, a missing object, Delete, and List's
// time bound and prefix.
func TestContract(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	ctx := t.Context()
	prefix := newPrefix()
	st := newStore(t, srv, prefix)
	const name = "0123456789abcdef-7"

	body := bytes.Repeat([]byte("a,b\n"), 1000)
	addr, err := st.Put(ctx, name, bytes.NewReader(body))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(addr, name+"."), addr)
	require.LessOrEqual(t, len(addr), 1024)
	addr2, err := st.Put(ctx, name, bytes.NewReader(body))
	require.NoError(t, err)
	require.NotEqual(t, addr, addr2, "a Put never overwrites an object")

	rc, err := st.Open(ctx, addr)
	require.NoError(t, err)
	got, err := io.ReadAll(rc)
	require.NoError(t, errors.Join(err, rc.Close()))
	require.Equal(t, body, got)

	empty, err := st.Put(ctx, name, bytes.NewReader(nil))
	require.NoError(t, err)
	rc, err = st.Open(ctx, empty)
	require.NoError(t, err)
	got, err = io.ReadAll(rc)
	require.NoError(t, errors.Join(err, rc.Close()))
	require.Empty(t, got)

	// List: by the server's LastModified, under the prefix only.
	require.ElementsMatch(t, []string{addr, addr2, empty}, list(t, st, time.Now().Add(time.Minute)))
	require.Empty(t, list(t, st, time.Now().Add(-time.Hour)), "written just now, not before an hour ago")
	c := srv.client(srv.endpoint)
	for _, k := range []string{"foreign-object", "sub/" + addr} {
		_, err = c.PutObject(ctx, &s3.PutObjectInput{Bucket: &srv.bucket, Key: aws.String(prefix + k), Body: strings.NewReader("x")})
		require.NoError(t, err)
	}
	require.ElementsMatch(t, []string{addr, addr2, empty}, list(t, st, time.Now().Add(time.Minute)),
		"keys not of the store's form are not listed")
	other := newStore(t, srv, newPrefix())
	require.Empty(t, list(t, other, time.Now().Add(time.Minute)), "another prefix lists nothing of this one")
	stop := errors.New("stop")
	calls := 0
	require.ErrorIs(t, st.List(ctx, time.Now().Add(time.Minute), func(string) error { calls++; return stop }), stop)
	require.Equal(t, 1, calls, "List stops at fn's first error")

	// Delete, and a missing object.
	require.NoError(t, st.Delete(ctx, addr))
	require.NoError(t, st.Delete(ctx, addr), "deleting a missing object is no error")
	_, err = st.Open(ctx, addr)
	require.ErrorIs(t, err, fs.ErrNotExist)
	for _, bad := range []string{"", "../x.0123456789abcdef", "sub/" + addr, "foreign-object"} {
		_, err = st.Open(ctx, bad)
		require.ErrorIs(t, err, fs.ErrNotExist, bad)
		require.NoError(t, st.Delete(ctx, bad), bad)
	}
	_, err = c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &srv.bucket, Key: aws.String(prefix + "foreign-object")})
	require.NoError(t, err, "Delete of an address not of the store's form touched nothing")
}

// TestMultipart: a body over PartSize is a multipart upload, stored and
// read back whole, including one of exactly PartSize bytes.
func TestMultipart(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	ctx := t.Context()
	st := newStore(t, srv, newPrefix())
	for _, n := range []int{idems3.MinPartSize, 2*idems3.MinPartSize + 12345} {
		body := make([]byte, n)
		for i := range body {
			body[i] = byte(i*7 + i/251)
		}
		addr, err := st.Put(ctx, "0123456789abcdef-1", bytes.NewReader(body))
		require.NoError(t, err)
		rc, err := st.Open(ctx, addr)
		require.NoError(t, err)
		h := sha256.New()
		m, err := io.Copy(h, rc)
		require.NoError(t, errors.Join(err, rc.Close()))
		require.Equal(t, int64(n), m)
		require.Equal(t, sha256.Sum256(body), [32]byte(h.Sum(nil)))
	}
}

// failingReader yields n bytes, then fails.
type failingReader struct{ n int }

var errRead = errors.New("the handler failed mid-body")

func (r *failingReader) Read(p []byte) (int, error) {
	if r.n == 0 {
		return 0, errRead
	}
	k := min(len(p), r.n)
	clear(p[:k])
	r.n -= k
	return k, nil
}

// TestPutFailsLeavesNothing: a body whose reader fails, before or after
// the first part, is an error matching the reader's, and leaves no object
// and no multipart upload behind.
func TestPutFailsLeavesNothing(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	ctx := t.Context()
	prefix := newPrefix()
	st := newStore(t, srv, prefix)
	for _, n := range []int{100, idems3.MinPartSize + 100} {
		_, err := st.Put(ctx, "0123456789abcdef-2", &failingReader{n: n})
		require.ErrorIs(t, err, errRead)
	}
	require.Empty(t, list(t, st, time.Now().Add(time.Minute)))
	out, err := srv.client(srv.endpoint).ListMultipartUploads(ctx, &s3.ListMultipartUploadsInput{Bucket: &srv.bucket, Prefix: &prefix})
	require.NoError(t, err)
	require.Empty(t, out.Uploads, "the failed upload was aborted")
}

// TestAbortUploads: an upload a crashed process left is aborted once it is
// older than the bound, and not before.
func TestAbortUploads(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	ctx := t.Context()
	prefix := newPrefix()
	st := newStore(t, srv, prefix)
	c := srv.client(srv.endpoint)
	_, err := c.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: &srv.bucket, Key: aws.String(prefix + "0123456789abcdef-3.0123456789abcdef")})
	require.NoError(t, err)
	n, err := st.AbortUploads(ctx, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	require.Equal(t, 0, n)
	n, err = st.AbortUploads(ctx, time.Now().Add(time.Minute))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	out, err := c.ListMultipartUploads(ctx, &s3.ListMultipartUploadsInput{Bucket: &srv.bucket, Prefix: &prefix})
	require.NoError(t, err)
	require.Empty(t, out.Uploads)
}

// TestUnavailable: a missing bucket or a closed port is an error that is
// not fs.ErrNotExist (idem answers ErrBodyUnavailable, not a corrupt
// record), from every method.
func TestUnavailable(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	ctx := t.Context()
	p := newProxy(t, srv.endpoint)
	down := srv.client(p.url())
	p.close(t)
	for name, st := range map[string]*idems3.Store{
		"no bucket":   must(idems3.New(idems3.Config{Client: srv.client(srv.endpoint), Bucket: "idem-no-such-bucket"})),
		"closed port": must(idems3.New(idems3.Config{Client: down, Bucket: srv.bucket})),
	} {
		_, err := st.Put(ctx, "0123456789abcdef-4", strings.NewReader("x"))
		require.Error(t, err, name)
		_, err = st.Open(ctx, "0123456789abcdef-4.0123456789abcdef")
		require.Error(t, err, name)
		require.NotErrorIs(t, err, fs.ErrNotExist, name)
		require.Error(t, st.List(ctx, time.Now(), func(string) error { return nil }), name)
		if name == "closed port" {
			require.Error(t, st.Delete(ctx, "0123456789abcdef-4.0123456789abcdef"), name)
		}
	}
}

func must(st *idems3.Store, err error) *idems3.Store {
	if err != nil {
		panic(err)
	}
	return st
}

// TestNewValidates: New refuses a config it cannot work with.
func TestNewValidates(t *testing.T) {
	t.Parallel()
	c := s3.New(s3.Options{Region: "us-east-1"})
	for name, cfg := range map[string]idems3.Config{
		"no client":  {Bucket: "b"},
		"no bucket":  {Client: c},
		"long":       {Client: c, Bucket: "b", Prefix: strings.Repeat("p", 513)},
		"small part": {Client: c, Bucket: "b", PartSize: 1 << 20},
	} {
		_, err := idems3.New(cfg)
		require.Error(t, err, name)
	}
	_, err := idems3.New(idems3.Config{Client: c, Bucket: "b", Prefix: "idem/", PartSize: 8 << 20})
	require.NoError(t, err)
}
