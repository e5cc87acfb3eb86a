package idemgrpc

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	spb "google.golang.org/genproto/googleapis/rpc/status"

	"github.com/idemstore/idem"
)

// How a gRPC result is stored as an [idem.Response] (the convention for
// results that are not HTTP responses; docs/integrations.md):
//
//   - StatusCode: 200 for OK; for a failure stored as final, the HTTP
//     status that grpc-gateway maps its code to (FailedPrecondition 400,
//     NotFound 404, ...), so that the record reads sensibly next to
//     idemhttp's and passes the store's 200-599 check.
//   - Header "Grpc-Status": the gRPC code as a decimal number ("0" for OK).
//   - Header "Grpc-Message-Type": the full name of the stored message's
//     type ("google.rpc.Status" for a failure).
//   - Body: the message in the deterministic protocol buffer encoding; for
//     a failure, the google.rpc.Status with its message and details.
const (
	headerStatus      = "Grpc-Status"
	headerMessageType = "Grpc-Message-Type"
	statusTypeName    = "google.rpc.Status"
)

var deterministic = proto.MarshalOptions{Deterministic: true}

// errTooLarge reports a response larger than Config.MaxResponseBytes.
var errTooLarge = errors.New("idemgrpc: response too large to store")

// encodeMessage stores a successful response message.
func encodeMessage(m proto.Message, maxBytes int) (*idem.Response, error) {
	if proto.Size(m) > maxBytes {
		return nil, errTooLarge
	}
	body, err := deterministic.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: marshal response: %w", err)
	}
	h := http.Header{}
	h.Set(headerStatus, "0")
	h.Set(headerMessageType, string(m.ProtoReflect().Descriptor().FullName()))
	return &idem.Response{StatusCode: http.StatusOK, Header: h, Body: body}, nil
}

// encodeStatus stores a failure marked final.
func encodeStatus(st *status.Status, maxBytes int) (*idem.Response, error) {
	p := st.Proto()
	if proto.Size(p) > maxBytes {
		return nil, errTooLarge
	}
	body, err := deterministic.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: marshal status: %w", err)
	}
	h := http.Header{}
	h.Set(headerStatus, strconv.Itoa(int(st.Code())))
	h.Set(headerMessageType, statusTypeName)
	return &idem.Response{StatusCode: httpStatus(st.Code()), Header: h, Body: body}, nil
}

// decode turns a stored response back into the handler's answer: the
// message of a success, or the status error of a stored failure. It never
// panics on damaged records; an error means the record cannot be replayed.
func decode(r *idem.Response) (proto.Message, *status.Status, error) {
	if r == nil {
		return nil, nil, errors.New("no stored response")
	}
	code, err := strconv.Atoi(r.Header.Get(headerStatus))
	if err != nil || code < 0 || code > 16 {
		return nil, nil, errors.New("stored response has no valid " + headerStatus)
	}
	typeName := r.Header.Get(headerMessageType)
	if code != int(codes.OK) {
		if typeName != statusTypeName {
			return nil, nil, errors.New("stored failure is not a " + statusTypeName)
		}
		var p spb.Status
		if err := proto.Unmarshal(r.Body, &p); err != nil {
			return nil, nil, fmt.Errorf("stored status does not decode: %w", err)
		}
		if p.GetCode() != int32(code) {
			return nil, nil, errors.New("stored status code disagrees with " + headerStatus)
		}
		return nil, status.FromProto(&p), nil
	}
	name := protoreflect.FullName(typeName)
	if !name.IsValid() {
		return nil, nil, errors.New("stored response has no valid " + headerMessageType)
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(name)
	if err != nil {
		return nil, nil, fmt.Errorf("stored response type is not linked into this server: %w", err)
	}
	m := mt.New().Interface()
	if err := proto.Unmarshal(r.Body, m); err != nil {
		return nil, nil, fmt.Errorf("stored response does not decode: %w", err)
	}
	return m, nil, nil
}

// httpStatus is grpc-gateway's mapping of gRPC codes to HTTP statuses.
func httpStatus(c codes.Code) int {
	switch c {
	case codes.OK:
		return http.StatusOK
	case codes.Canceled:
		return 499
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.NotFound:
		return http.StatusNotFound
	case codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.Unimplemented:
		return http.StatusNotImplemented
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	default: // Unknown, Internal, DataLoss
		return http.StatusInternalServerError
	}
}
