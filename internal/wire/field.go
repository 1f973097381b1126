package wire

import (
	"fmt"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"
)

// The protobuf library says why a message does not encode or decode
// ("string field contains invalid UTF-8", "cannot parse invalid wire-format
// data") but not where. The functions below find the field, so a refusal
// names it: "start_load.meta.params.rank_exports[1].capability".

// fieldErr prefixes err with the path of the field it is about, when one
// was found.
func fieldErr(path string, err error) error {
	if path == "" {
		return err
	}
	return fmt.Errorf("field %s: %w", path, err)
}

// undecodableField returns the path from md of the first field of the
// encoded message b that does not decode, or "" when none can be singled
// out. A field that is well formed but of another wire type than its
// declaration is not one: the library keeps it as an unknown field.
func undecodableField(md protoreflect.MessageDescriptor, b []byte) string {
	seen := map[protowire.Number]int{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return ""
		}
		fd := md.Fields().ByNumber(num)
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			if fd == nil {
				return ""
			}
			return string(fd.Name()) // cut short inside it
		}
		field, val := b[:n+m], b[n:n+m]
		b = b[n+m:]
		if fd == nil {
			continue
		}
		i := seen[num]
		seen[num]++
		if proto.Unmarshal(field, dynamicpb.NewMessage(md)) == nil {
			continue
		}
		path := string(fd.Name())
		if fd.Message() == nil || fd.IsMap() || typ != protowire.BytesType {
			return path
		}
		if fd.IsList() {
			path = fmt.Sprintf("%s[%d]", path, i)
		}
		inner, _ := protowire.ConsumeBytes(val)
		if sub := undecodableField(fd.Message(), inner); sub != "" {
			return path + "." + sub
		}
		return path
	}
	return ""
}

// unencodableField returns the path from m of the first populated field
// that does not encode, or "" when none can be singled out.
func unencodableField(m protoreflect.Message) string {
	var path string
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		one := m.New()
		one.Set(fd, v)
		if _, err := proto.Marshal(one.Interface()); err == nil {
			return true
		}
		path = string(fd.Name())
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i, l := 0, v.List(); i < l.Len(); i++ {
				if sub := unencodableField(l.Get(i).Message()); sub != "" {
					path = fmt.Sprintf("%s[%d].%s", path, i, sub)
					break
				}
			}
		case fd.Message() != nil && !fd.IsList() && !fd.IsMap():
			if sub := unencodableField(v.Message()); sub != "" {
				path += "." + sub
			}
		}
		return false
	})
	return path
}
