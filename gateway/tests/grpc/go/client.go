// A stock grpc-go client (Debian's golang-google-grpc-dev) on sbxd's Unix socket, with no
// options beyond the socket: it asks the gateway what it is, creates a sandbox, reads it back
// until it runs and deletes it. There are no generated stubs here (Debian ships no
// protoc-gen-go-grpc for this grpc-go): the messages are written and read as protobuf wire
// bytes by the few lines below, and passed through grpc-go by a codec that leaves bytes as
// they are. What is tested is grpc-go's transport: its dialer, the :authority it sends for a
// socket path, its HTTP/2.
//
// Usage: client SOCKET NAME. Prints one line per step; exits 1 with the error otherwise.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
)

// raw passes messages through as the protobuf bytes they already are.
type raw struct{}

func (raw) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (raw) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (raw) Name() string   { return "proto" }
func (raw) String() string { return "proto" }

func varint(n uint64) []byte {
	var out []byte
	for n >= 0x80 {
		out = append(out, byte(n)|0x80)
		n >>= 7
	}
	return append(out, byte(n))
}

// field is a length-delimited field (a string, bytes or a message).
func field(num uint64, body []byte) []byte {
	out := varint(num<<3 | 2)
	out = append(out, varint(uint64(len(body)))...)
	return append(out, body...)
}

// fields reads the top-level fields of a message: varints and length-delimited ones.
func fields(msg []byte) (map[uint64][]byte, map[uint64]uint64) {
	bytesOf := map[uint64][]byte{}
	ints := map[uint64]uint64{}
	for len(msg) > 0 {
		key, n := readVarint(msg)
		msg = msg[n:]
		switch key & 7 {
		case 0:
			v, n := readVarint(msg)
			ints[key>>3] = v
			msg = msg[n:]
		case 2:
			l, n := readVarint(msg)
			msg = msg[n:]
			bytesOf[key>>3] = msg[:l]
			msg = msg[l:]
		default:
			return bytesOf, ints
		}
	}
	return bytesOf, ints
}

func readVarint(b []byte) (uint64, int) {
	var v uint64
	for i, c := range b {
		v |= uint64(c&0x7f) << (7 * uint(i))
		if c < 0x80 {
			return v, i + 1
		}
	}
	return v, len(b)
}

func fail(what string, err error) {
	fmt.Fprintf(os.Stderr, "%s: %v\n", what, err)
	os.Exit(1)
}

func main() {
	socket, name := os.Args[1], os.Args[2]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// grpc-go 1.33 has no unix: scheme of its own: the dialer is how its users reach a
	// socket, and the target (the socket's path) becomes the :authority it sends.
	conn, err := grpc.DialContext(ctx, socket,
		grpc.WithInsecure(),
		grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(raw{})),
	)
	if err != nil {
		fail("dial", err)
	}
	defer conn.Close()

	call := func(method string, req []byte) []byte {
		var resp []byte
		if err := conn.Invoke(ctx, method, &req, &resp); err != nil {
			fail(method, err)
		}
		return resp
	}

	info, _ := fields(call("/sbx.v1.GatewayService/GetGatewayInfo", nil))
	fmt.Printf("driver %s\n", info[2])

	spec := append(field(1, []byte("sleep")), field(1, []byte("60"))...)
	created, _ := fields(call("/sbx.v1.SandboxService/CreateSandbox",
		append(field(2, []byte(name)), field(3, spec)...)))
	id := string(created[1])
	ref := field(1, field(1, []byte(id)))
	phase := uint64(0)
	for i := 0; i < 300 && phase != 2; i++ {
		_, ints := fields(call("/sbx.v1.SandboxService/GetSandbox", ref))
		phase = ints[7]
		if phase != 2 {
			time.Sleep(100 * time.Millisecond)
		}
	}
	fmt.Printf("created %s phase %d\n", strings.TrimSpace(string(created[4])), phase)

	_, deleted := fields(call("/sbx.v1.SandboxService/DeleteSandbox", ref))
	fmt.Printf("deleted %v\n", deleted[1] == 1)
}
