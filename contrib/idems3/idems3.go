// Package idems3 is an [idem.BodyStore] in an S3-compatible object store:
// response bodies too large to keep in the record (Config.BodyStore,
// Config.InlineBodyMax) are written to a bucket, and the record keeps
// their address, length and SHA-256.
//
// Each Put writes a new object, never an existing one: its key is the
// store's prefix, idem's name for the object and a random suffix. A body
// of up to PartSize bytes is one PutObject; a larger one, whose length idem
// does not know in advance (idemhttp streams it while the handler writes),
// is a multipart upload of PartSize parts sent one at a time, so a Put
// holds one part in memory whatever the body's size. Open streams the
// object from GetObject.
//
// What it needs from the bucket:
//   - read-after-write consistency for new objects (S3 and the common
//     S3-compatible servers have it): idem commits the record right after
//     Put and may replay it from another process at once;
//   - durability on acknowledgement: Put returns when the server answered
//     the PutObject or CompleteMultipartUpload, and idem commits the record
//     that names the object then;
//   - no versioning assumptions either way: Delete removes the current
//     version (on a versioned bucket it leaves a delete marker and the old
//     version, which the bucket's own lifecycle rules must expire);
//   - lifecycle rules that never expire an object younger than the idem
//     store's Retention plus the reaper's BodyGrace (a record whose object
//     expired first replays idem.ErrCorruptRecord); a rule that aborts
//     incomplete multipart uploads after a day is advised (a process that
//     crashes mid-upload leaves one; see also [Store.AbortUploads]).
//
// The sweep ([idem.Store.SweepBodies], the reaper) compares LastModified,
// the server's clock, with the application's: the grace period must exceed
// any skew between the two.
package idems3

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"

	"github.com/idemstore/idem"
)

// MinPartSize is the smallest part S3 accepts in a multipart upload (but
// for the last one), and so the smallest Config.PartSize.
const MinPartSize = 5 << 20

// maxParts is S3's limit on the parts of one multipart upload.
const maxParts = 10000

// maxPrefix leaves room, within S3's 1024-byte keys, for idem's addresses
// (an object name of about 40 bytes and this store's suffix).
const maxPrefix = 512

// Config configures a [Store].
type Config struct {
	// Client is the S3 client, configured with the endpoint, region and
	// credentials (for most S3-compatible servers also UsePathStyle).
	// Required.
	Client *s3.Client
	// Bucket is the bucket holding the objects; it must exist. Required.
	Bucket string
	// Prefix is prepended to every object's key, such as "idem/bodies/",
	// so that the bucket may hold other objects: List reports only keys
	// under it, of this store's form. At most 512 bytes. Defaults to none.
	Prefix string
	// PartSize is the size of each part of a multipart upload, and so what
	// one Put holds in memory; bodies up to PartSize are written in one
	// PutObject. A body may have at most 10,000 parts. Defaults to
	// MinPartSize (5 MiB, bodies up to about 48 GiB).
	PartSize int64
}

// Store is an [idem.BodyStore] in an S3 bucket. It is safe for concurrent
// use.
type Store struct {
	client   *s3.Client
	bucket   string
	prefix   string
	partSize int64
}

var _ idem.BodyStore = (*Store)(nil)

// New returns a Store on cfg's bucket. It does not contact the server.
func New(cfg Config) (*Store, error) {
	switch {
	case cfg.Client == nil:
		return nil, errors.New("idems3: Config.Client is required")
	case cfg.Bucket == "":
		return nil, errors.New("idems3: Config.Bucket is required")
	case len(cfg.Prefix) > maxPrefix:
		return nil, fmt.Errorf("idems3: Config.Prefix is longer than %d bytes", maxPrefix)
	case cfg.PartSize != 0 && cfg.PartSize < MinPartSize:
		return nil, fmt.Errorf("idems3: Config.PartSize is less than %d bytes", MinPartSize)
	}
	if cfg.PartSize == 0 {
		cfg.PartSize = MinPartSize
	}
	return &Store{client: cfg.Client, bucket: cfg.Bucket, prefix: cfg.Prefix, partSize: cfg.PartSize}, nil
}

// suffixLen is the length of the random suffix, in hex digits, after the
// '.' that ends idem's name in an address.
const suffixLen = 16

// ourAddress reports whether a is an address of this store's form: idem's
// name, '.', and a suffix of suffixLen hex digits, in printable ASCII
// without '/' (an address read from a damaged record must not name a key
// outside the store's prefix).
func ourAddress(a string) bool {
	name, suffix, ok := cutLast(a, '.')
	if !ok || name == "" || len(suffix) != suffixLen || len(a) > 1024 {
		return false
	}
	if _, err := hex.DecodeString(suffix); err != nil {
		return false
	}
	for i := 0; i < len(a); i++ {
		if a[i] <= ' ' || a[i] > '~' || a[i] == '/' {
			return false
		}
	}
	return true
}

func cutLast(s string, sep byte) (before, after string, found bool) {
	if i := strings.LastIndexByte(s, sep); i >= 0 {
		return s[:i], s[i+1:], true
	}
	return s, "", false
}

// Put implements [idem.BodyStore]: it writes r to a new object and returns
// its address, "<name>.<random suffix>". On error it leaves nothing that a
// record names: a failed multipart upload is aborted (one the abort could
// not reach is invisible to List and removed by [Store.AbortUploads] or
// the bucket's lifecycle rule).
func (s *Store) Put(ctx context.Context, name string, r io.Reader) (string, error) {
	var rnd [suffixLen / 2]byte
	_, _ = rand.Read(rnd[:])
	addr := name + "." + hex.EncodeToString(rnd[:])
	if strings.Contains(name, ".") || !ourAddress(addr) {
		return "", errors.New("idems3: invalid object name")
	}
	key := s.prefix + addr
	// Most bodies are far smaller than a part: read a small first chunk,
	// and allocate a whole part only for a body that fills it.
	first := make([]byte, min(firstChunk, s.partSize))
	n, err := readFull(r, first)
	if err != nil {
		return "", err
	}
	if n == len(first) && n < int(s.partSize) {
		buf := make([]byte, s.partSize)
		copy(buf, first)
		m, err := readFull(r, buf[n:])
		if err != nil {
			return "", err
		}
		first, n = buf, n+m
	}
	if n < int(s.partSize) {
		_, err := s.client.PutObject(ctx, &s3.PutObjectInput{
			Bucket: &s.bucket, Key: &key, Body: bytes.NewReader(first[:n]), ContentLength: aws.Int64(int64(n)),
		})
		if err != nil {
			return "", fmt.Errorf("idems3: put object: %w", err)
		}
		return addr, nil
	}
	if err := s.putMultipart(ctx, key, first, r); err != nil {
		return "", err
	}
	return addr, nil
}

// firstChunk is what Put reads before it knows whether the body fills a
// part.
const firstChunk = 256 << 10

// readFull reads from r into buf until buf is full or r ends, and returns
// how many bytes it read; the end of r is no error.
func readFull(r io.Reader, buf []byte) (int, error) {
	n, err := io.ReadFull(r, buf)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return n, fmt.Errorf("idems3: read body: %w", err)
	}
	return n, nil
}

// putMultipart uploads key in parts of len(buf) bytes, the first already
// in buf, the rest read from r into buf: one part in memory at a time.
func (s *Store) putMultipart(ctx context.Context, key string, buf []byte, r io.Reader) error {
	// Each part carries its CRC32, checked by the server, and the
	// completion names them: the algorithm is declared up front, as S3
	// requires for per-part checksums.
	up, err := s.client.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{
		Bucket: &s.bucket, Key: &key, ChecksumAlgorithm: types.ChecksumAlgorithmCrc32,
	})
	if err != nil {
		return fmt.Errorf("idems3: create multipart upload: %w", err)
	}
	done := false
	defer func() {
		if !done {
			// Bounded, and not cancelled with ctx: the parts take space
			// until the upload is aborted.
			actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_, _ = s.client.AbortMultipartUpload(actx, &s3.AbortMultipartUploadInput{Bucket: &s.bucket, Key: &key, UploadId: up.UploadId})
		}
	}()
	var parts []types.CompletedPart
	n := len(buf)
	for num := int32(1); n > 0; num++ {
		if num > maxParts {
			return fmt.Errorf("idems3: body has more than %d parts of %d bytes", maxParts, len(buf))
		}
		out, err := s.client.UploadPart(ctx, &s3.UploadPartInput{
			Bucket: &s.bucket, Key: &key, UploadId: up.UploadId, PartNumber: aws.Int32(num),
			Body: bytes.NewReader(buf[:n]), ContentLength: aws.Int64(int64(n)), ChecksumAlgorithm: types.ChecksumAlgorithmCrc32,
		})
		if err != nil {
			return fmt.Errorf("idems3: upload part %d: %w", num, err)
		}
		parts = append(parts, types.CompletedPart{ETag: out.ETag, PartNumber: aws.Int32(num), ChecksumCRC32: out.ChecksumCRC32})
		if n < len(buf) {
			break // a short read was the end of the body
		}
		if n, err = readFull(r, buf); err != nil {
			return err
		}
	}
	_, err = s.client.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{
		Bucket: &s.bucket, Key: &key, UploadId: up.UploadId,
		MultipartUpload: &types.CompletedMultipartUpload{Parts: parts},
	})
	if err != nil {
		return fmt.Errorf("idems3: complete multipart upload: %w", err)
	}
	done = true
	return nil
}

// Open implements [idem.BodyStore]: it streams the object. A missing
// object (NoSuchKey), or an address that is not of this store's form,
// matches [fs.ErrNotExist]; a missing bucket, denied access or an
// unreachable server is any other error.
func (s *Store) Open(ctx context.Context, address string) (io.ReadCloser, error) {
	if !ourAddress(address) {
		return nil, fmt.Errorf("idems3: not an address of this store: %w", fs.ErrNotExist)
	}
	out, err := s.client.GetObject(ctx, &s3.GetObjectInput{Bucket: &s.bucket, Key: aws.String(s.prefix + address)})
	if err != nil {
		if isNoSuchKey(err) {
			return nil, fmt.Errorf("idems3: get object: %w", errors.Join(fs.ErrNotExist, err))
		}
		return nil, fmt.Errorf("idems3: get object: %w", err)
	}
	return out.Body, nil
}

func isNoSuchKey(err error) bool {
	var nsk *types.NoSuchKey
	if errors.As(err, &nsk) {
		return true
	}
	var api smithy.APIError
	return errors.As(err, &api) && api.ErrorCode() == "NoSuchKey"
}

// Delete implements [idem.BodyStore]. Deleting a missing object, or an
// address not of this store's form, is no error.
func (s *Store) Delete(ctx context.Context, address string) error {
	if !ourAddress(address) {
		return nil
	}
	_, err := s.client.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: &s.bucket, Key: aws.String(s.prefix + address)})
	if err != nil && !isNoSuchKey(err) {
		return fmt.Errorf("idems3: delete object: %w", err)
	}
	return nil
}

// List implements [idem.BodyStore]: it lists the keys under the prefix
// (ListObjectsV2) and reports those of this store's form whose
// LastModified, the server's time, is before writtenBefore.
func (s *Store) List(ctx context.Context, writtenBefore time.Time, fn func(address string) error) error {
	p := s3.NewListObjectsV2Paginator(s.client, &s3.ListObjectsV2Input{Bucket: &s.bucket, Prefix: aws.String(s.prefix)})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return fmt.Errorf("idems3: list objects: %w", err)
		}
		for _, o := range page.Contents {
			addr, ok := strings.CutPrefix(aws.ToString(o.Key), s.prefix)
			if !ok || !ourAddress(addr) || o.LastModified == nil || !o.LastModified.Before(writtenBefore) {
				continue
			}
			if err := fn(addr); err != nil {
				return err
			}
		}
	}
	return nil
}

// AbortUploads aborts the multipart uploads under the prefix that were
// started before startedBefore: those of a process that crashed during a
// Put, whose parts take space but no object holds. startedBefore must be
// older than the longest Put. It returns how many it aborted. A bucket
// lifecycle rule (AbortIncompleteMultipartUpload) does the same on the
// server's side.
func (s *Store) AbortUploads(ctx context.Context, startedBefore time.Time) (int, error) {
	in := &s3.ListMultipartUploadsInput{Bucket: &s.bucket, Prefix: aws.String(s.prefix)}
	n := 0
	for {
		out, err := s.client.ListMultipartUploads(ctx, in)
		if err != nil {
			return n, fmt.Errorf("idems3: list multipart uploads: %w", err)
		}
		for _, u := range out.Uploads {
			addr, ok := strings.CutPrefix(aws.ToString(u.Key), s.prefix)
			if !ok || !ourAddress(addr) || u.Initiated == nil || !u.Initiated.Before(startedBefore) {
				continue
			}
			_, err := s.client.AbortMultipartUpload(ctx, &s3.AbortMultipartUploadInput{Bucket: &s.bucket, Key: u.Key, UploadId: u.UploadId})
			if err != nil {
				return n, fmt.Errorf("idems3: abort multipart upload: %w", err)
			}
			n++
		}
		if !aws.ToBool(out.IsTruncated) {
			return n, nil
		}
		in.KeyMarker, in.UploadIdMarker = out.NextKeyMarker, out.NextUploadIdMarker
	}
}
