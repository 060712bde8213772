//! Codecs per topic through the broker-free test driver: protobuf (from the descriptor set
//! in tests/data), JSON, UTF-8 string and raw bytes, with exact outputs and dead letters.

use onceflow::headers::dlq_headers;
use onceflow::KeySource;
use onceflow::ProtoFormat;
use onceflow::{EnrichSpec, Format, TableSpec, TopologyBuilder};
use onceflow::{TestDriver, TestRecord};
use prost::Message;
use prost_reflect::{DynamicMessage, Value as PValue};
use prost_types::{
    field_descriptor_proto::{Label, Type},
    DescriptorProto, FieldDescriptorProto, FileDescriptorProto, FileDescriptorSet,
};

const DESC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/shop.desc");

fn field(
    name: &str,
    number: i32,
    ty: Type,
    label: Label,
    type_name: Option<&str>,
) -> FieldDescriptorProto {
    FieldDescriptorProto {
        name: Some(name.into()),
        number: Some(number),
        r#type: Some(ty as i32),
        label: Some(label as i32),
        type_name: type_name.map(Into::into),
        json_name: Some(json_name(name)),
        ..Default::default()
    }
}

fn json_name(s: &str) -> String {
    let mut out = String::new();
    let mut up = false;
    for c in s.chars() {
        if c == '_' {
            up = true;
        } else if up {
            out.extend(c.to_uppercase());
            up = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// The FileDescriptorSet of tests/data/shop.proto, built field by field.
fn shop_descriptor_set() -> FileDescriptorSet {
    use Label::{Optional as O, Repeated as R};
    let order_fields = || {
        vec![
            field("order_id", 1, Type::String, O, None),
            field("customer_id", 2, Type::String, O, None),
            field("amount_cents", 3, Type::Int64, O, None),
            field("items", 4, Type::String, R, None),
        ]
    };
    let mut enriched = order_fields();
    enriched.push(field(
        "customer",
        5,
        Type::Message,
        O,
        Some(".shop.Customer"),
    ));
    let msg = |name: &str, fields| DescriptorProto {
        name: Some(name.into()),
        field: fields,
        ..Default::default()
    };
    FileDescriptorSet {
        file: vec![FileDescriptorProto {
            name: Some("shop.proto".into()),
            package: Some("shop".into()),
            syntax: Some("proto3".into()),
            message_type: vec![
                msg("Order", order_fields()),
                msg(
                    "Customer",
                    vec![
                        field("name", 1, Type::String, O, None),
                        field("tier", 2, Type::String, O, None),
                    ],
                ),
                msg("EnrichedOrder", enriched),
            ],
            ..Default::default()
        }],
    }
}

#[test]
fn descriptor_set_file_is_current() {
    let built = shop_descriptor_set().encode_to_vec();
    if std::env::var_os("ONCEFLOW_REGEN_DESCRIPTORS").is_some() {
        std::fs::write(DESC, &built).unwrap();
    }
    let on_disk = std::fs::read(DESC).expect("tests/data/shop.desc (regenerate: see shop.proto)");
    assert_eq!(
        on_disk, built,
        "tests/data/shop.desc is stale; see tests/data/shop.proto"
    );
}

fn proto(message: &str) -> Format {
    Format::Protobuf(ProtoFormat::from_file(DESC, message).unwrap())
}

fn order_bytes(id: &str, customer: &str, cents: i64, items: &[&str]) -> Vec<u8> {
    let Format::Protobuf(p) = proto("shop.Order") else {
        unreachable!()
    };
    let mut m = DynamicMessage::new(p.descriptor().clone());
    m.set_field_by_name("order_id", PValue::String(id.into()));
    m.set_field_by_name("customer_id", PValue::String(customer.into()));
    m.set_field_by_name("amount_cents", PValue::I64(cents));
    m.set_field_by_name(
        "items",
        PValue::List(
            items
                .iter()
                .map(|s| PValue::String(s.to_string()))
                .collect(),
        ),
    );
    m.encode_to_vec()
}

fn dlq_reason(d: &TestDriver, i: usize) -> String {
    let r = d.dead_letters()[i];
    let h = r
        .headers
        .iter()
        .find(|(k, _)| k == dlq_headers::REASON)
        .unwrap();
    String::from_utf8(h.1.as_ref().unwrap().to_vec()).unwrap()
}

#[test]
fn protobuf_source_to_json_sink() {
    let t = TopologyBuilder::new("t")
        .source("orders", proto("shop.Order"))
        .sink("out", "orders.json")
        .topic_format("orders.json", Format::Json)
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json(order_bytes("o1", "c1", 1250, &["tea", "cup"])).key("o1"))
        .unwrap();
    d.pipe(TestRecord::json(Vec::new())).unwrap(); // the empty message: all defaults
    assert_eq!(
        d.output_values("orders.json"),
        vec![
            r#"{"order_id":"o1","customer_id":"c1","amount_cents":1250,"items":["tea","cup"]}"#,
            r#"{"order_id":"","customer_id":"","amount_cents":0,"items":[]}"#,
        ]
    );
    assert_eq!(d.output("orders.json")[0].key.as_deref(), Some(&b"o1"[..]));
}

#[test]
fn protobuf_round_trip_through_json() {
    // JSON in, protobuf out ...
    let to_proto = TopologyBuilder::new("a")
        .source("orders.json", Format::Json)
        .sink("out", "orders.pb")
        .topic_format("orders.pb", proto("shop.Order"))
        .build()
        .unwrap();
    let mut a = TestDriver::new(to_proto);
    let input = r#"{"order_id":"o7","customer_id":"c3","amount_cents":99,"items":["pen"]}"#;
    a.pipe(TestRecord::json(input)).unwrap();
    let pb = a.output("orders.pb")[0].value.clone().unwrap();
    assert_eq!(
        pb.as_ref(),
        order_bytes("o7", "c3", 99, &["pen"]).as_slice()
    );
    // ... and back: protobuf in, JSON out, the same text.
    let to_json = TopologyBuilder::new("b")
        .source("orders.pb", proto("shop.Order"))
        .sink("out", "orders.json2")
        .topic_format("orders.json2", Format::Json)
        .build()
        .unwrap();
    let mut b = TestDriver::new(to_json);
    b.pipe(TestRecord::json(pb.to_vec())).unwrap();
    assert_eq!(b.output_values("orders.json2"), vec![input]);
}

#[test]
fn undecodable_values_are_dead_lettered_with_the_reason() {
    let t = TopologyBuilder::new("t")
        .source("orders", proto("shop.Order"))
        .sink("out", "out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    // Field 1 (string) claims 5 bytes but has 1.
    d.pipe(TestRecord::json(vec![0x0a, 0x05, b'a']).key("k"))
        .unwrap();
    d.pipe(TestRecord::null_value()).unwrap();
    d.pipe(TestRecord::json(order_bytes("o1", "c1", 5, &[])))
        .unwrap();
    assert_eq!(d.dead_letters().len(), 2);
    assert_eq!(
        dlq_reason(&d, 0),
        "value is not a valid protobuf shop.Order: failed to decode Protobuf message: buffer underflow"
    );
    assert_eq!(
        dlq_reason(&d, 1),
        "value is null, expected protobuf shop.Order"
    );
    // The dead letter carries the source bytes and key as read.
    assert_eq!(
        d.dead_letters()[0].value.as_deref(),
        Some(&[0x0a, 0x05, b'a'][..])
    );
    assert_eq!(d.dead_letters()[0].key.as_deref(), Some(&b"k"[..]));
    // protobuf -> protobuf of the same type: the message passes.
    assert_eq!(
        d.output("out")[0].value.as_deref(),
        Some(order_bytes("o1", "c1", 5, &[]).as_slice())
    );
}

#[test]
fn string_codec_and_bytes_passthrough() {
    let t = TopologyBuilder::new("t")
        .source("lines", Format::String)
        .sink("as-json", "lines.json")
        .sink("as-text", "lines.text")
        .topic_format("lines.json", Format::Json)
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json("héllo \"q\"")).unwrap();
    d.pipe(TestRecord::json(vec![b'a', 0xff])).unwrap();
    assert_eq!(d.output_values("lines.json"), vec![r#""héllo \"q\"""#]);
    assert_eq!(d.output_values("lines.text"), vec!["héllo \"q\""]);
    assert_eq!(
        dlq_reason(&d, 0),
        "value is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 1"
    );

    let t = TopologyBuilder::new("t")
        .source("raw", Format::Bytes)
        .sink("out", "raw.out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    let junk = vec![0u8, 0xff, b'{', 0x80];
    d.pipe(TestRecord::json(junk.clone())).unwrap();
    d.pipe(TestRecord::null_value()).unwrap();
    assert_eq!(
        d.output("raw.out")[0].value.as_deref(),
        Some(junk.as_slice())
    );
    assert_eq!(d.output("raw.out")[1].value, None);
    assert!(d.dead_letters().is_empty());
}

#[test]
fn json_values_that_do_not_fit_the_sink_message_are_dead_lettered() {
    let t = TopologyBuilder::new("t")
        .source("orders.json", Format::Json)
        .sink("out", "orders.pb")
        .topic_format("orders.pb", proto("shop.Order"))
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json(r#"{"order_id":"o1","colour":"red"}"#))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"order_id":5}"#)).unwrap();
    d.pipe(TestRecord::json(r#"{"order_id":"o2"}"#)).unwrap();
    assert_eq!(d.output("orders.pb").len(), 1);
    assert_eq!(d.dead_letters().len(), 2);
    let stage = |i: usize| {
        let r = d.dead_letters()[i];
        let h = r
            .headers
            .iter()
            .find(|(k, _)| k == dlq_headers::STAGE)
            .unwrap();
        String::from_utf8(h.1.as_ref().unwrap().to_vec()).unwrap()
    };
    // The refusing stage is named as the topology names it.
    assert_eq!(stage(0), "out");
    assert_eq!(
        dlq_reason(&d, 0),
        "the record does not fit protobuf shop.Order: unrecognized field name 'colour'"
    );
    assert_eq!(
        dlq_reason(&d, 1),
        "the record does not fit protobuf shop.Order: invalid type: integer `5`, expected a string"
    );
}

#[test]
fn protobuf_table_enriches_into_a_protobuf_sink() {
    let t = TopologyBuilder::new("t")
        .source("orders", proto("shop.Order"))
        .table(TableSpec::new("customers", "customers").format(proto("shop.Customer")))
        .enrich(
            "join",
            EnrichSpec::new(
                "customers",
                KeySource::JsonPointer("/customer_id".into()),
                "/customer",
            ),
        )
        .sink("out", "orders.enriched")
        .topic_format("orders.enriched", proto("shop.EnrichedOrder"))
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    let Format::Protobuf(cust) = proto("shop.Customer") else {
        unreachable!()
    };
    let mut c = DynamicMessage::new(cust.descriptor().clone());
    c.set_field_by_name("name", PValue::String("Ada".into()));
    c.set_field_by_name("tier", PValue::String("gold".into()));
    d.pipe_table("customers", TestRecord::json(c.encode_to_vec()).key("c1"))
        .unwrap();
    d.pipe(TestRecord::json(order_bytes("o1", "c1", 300, &["x"])))
        .unwrap();
    let Format::Protobuf(enr) = proto("shop.EnrichedOrder") else {
        unreachable!()
    };
    let out = d.output("orders.enriched")[0].value.clone().unwrap();
    let m = DynamicMessage::decode(enr.descriptor().clone(), out.as_ref()).unwrap();
    let json = serde_json::to_string(&m).unwrap();
    assert_eq!(
        json,
        r#"{"orderId":"o1","customerId":"c1","amountCents":"300","items":["x"],"customer":{"name":"Ada","tier":"gold"}}"#
    );
}

#[test]
fn dedup_by_pointer_on_a_protobuf_source() {
    use onceflow::DedupSpec;
    let t = TopologyBuilder::new("t")
        .source("orders", proto("shop.Order"))
        .dedup(
            "dedup",
            DedupSpec::new(KeySource::JsonPointer("/order_id".into())),
        )
        .sink("out", "out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json(order_bytes("o1", "c1", 1, &[])).timestamp(0))
        .unwrap();
    d.pipe(TestRecord::json(order_bytes("o1", "c2", 2, &[])).timestamp(1))
        .unwrap();
    d.pipe(TestRecord::json(order_bytes("o2", "c1", 3, &[])).timestamp(2))
        .unwrap();
    let got: Vec<Vec<u8>> = d
        .output("out")
        .iter()
        .map(|r| r.value.as_ref().unwrap().to_vec())
        .collect();
    assert_eq!(
        got,
        vec![
            order_bytes("o1", "c1", 1, &[]),
            order_bytes("o2", "c1", 3, &[])
        ]
    );
    assert_eq!(d.counts().duplicates, 1);
}

/// Reading a value never changes it: a stage that only reads the view (a filter on the
/// whole value, a dedup) leaves the value bytes as read for a sink of the source's format.
/// A protobuf message keeps the fields its descriptor does not know (a newer producer's),
/// and a JSON value keeps its numbers' digits and its spacing. Found by a review helper
/// (protobuf); a filter on `size(value)` showed the JSON case (`1.50` became `1.5`, an
/// integer beyond 64 bits a float). A `map` still writes its result.
#[test]
fn a_value_only_read_is_written_as_read() {
    let t = TopologyBuilder::new("t")
        .source("orders", proto("shop.Order"))
        .filter("any", |_| Ok(true))
        .sink("out", "out")
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    let mut bytes = order_bytes("o1", "c1", 5, &["a"]);
    // Field 99, length-delimited: "v2" from a newer schema.
    bytes.extend_from_slice(&[0x9a, 0x06, 0x02, b'v', b'2']);
    d.pipe(TestRecord::json(bytes.clone())).unwrap();
    assert!(d.dead_letters().is_empty());
    assert_eq!(d.output("out")[0].value.as_deref(), Some(bytes.as_slice()));

    let t = onceflow::dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in }\nstages:\n  - filter: { name: f, when: 'size(value) > 1' }\n  - sink: { topic: out }\n  - map: { name: m, set: { n: 'value.n + 1' } }\n  - sink: { name: mapped, topic: mapped }\n",
    )
    .unwrap();
    let mut d = TestDriver::new(t);
    let input = r#"{"n": 1, "big": 18446744073709551617, "x": 1.50}"#;
    d.pipe(TestRecord::json(input)).unwrap();
    assert_eq!(d.output_values("out"), [input]);
    assert_eq!(
        d.output_values("mapped"),
        [r#"{"n":2,"big":1.8446744073709552e+19,"x":1.5}"#]
    );
}

/// proto3 `message t.Num { string id = 1; float f = 2; uint64 u = 3; int64 n = 4;
/// optional string opt = 5; }`, written to a file in `dir`.
fn num_format(dir: &tempfile::TempDir) -> ProtoFormat {
    let opt = FieldDescriptorProto {
        proto3_optional: Some(true),
        oneof_index: Some(0),
        ..field("opt", 5, Type::String, Label::Optional, None)
    };
    let set = FileDescriptorSet {
        file: vec![FileDescriptorProto {
            name: Some("num.proto".into()),
            package: Some("t".into()),
            syntax: Some("proto3".into()),
            message_type: vec![DescriptorProto {
                name: Some("Num".into()),
                field: vec![
                    field("id", 1, Type::String, Label::Optional, None),
                    field("f", 2, Type::Float, Label::Optional, None),
                    field("u", 3, Type::Uint64, Label::Optional, None),
                    field("n", 4, Type::Int64, Label::Optional, None),
                    opt,
                ],
                oneof_decl: vec![prost_types::OneofDescriptorProto {
                    name: Some("_opt".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }],
    };
    let path = dir.path().join("num.desc");
    std::fs::write(&path, set.encode_to_vec()).unwrap();
    ProtoFormat::from_file(&path, "t.Num").unwrap()
}

/// README "Keys from JSON fields": a missing field is no key. A proto3 field without
/// presence reads as its default when absent, so three orders without an `order_id` were
/// one key `""` (two dropped as duplicates: review 11). Such a field at its default is
/// absent; a field declared `optional` keys by its default when set to it.
#[test]
fn a_protobuf_key_field_not_set_is_no_key() {
    let dedup_by = |format: Format, pointer: &str| {
        TestDriver::new(
            TopologyBuilder::new("t")
                .source("in", format)
                .dedup(
                    "dedup",
                    onceflow::DedupSpec::new(KeySource::JsonPointer(pointer.into())),
                )
                .sink("out", "out")
                .build()
                .unwrap(),
        )
    };
    let mut d = dedup_by(proto("shop.Order"), "/order_id");
    for (i, customer) in ["c1", "c2", "c3"].iter().enumerate() {
        d.pipe(
            TestRecord::json(order_bytes("", customer, 100 + i as i64, &[])).timestamp(i as i64),
        )
        .unwrap();
    }
    d.pipe(TestRecord::json(order_bytes("o-1", "c1", 1, &[])))
        .unwrap();
    assert_eq!(d.counts().duplicates, 0, "{:?}", d.counts());
    assert_eq!(d.output("out").len(), 1);
    assert_eq!(d.dead_letters().len(), 3);
    assert!(
        dlq_reason(&d, 0).contains("/order_id is not set"),
        "{}",
        dlq_reason(&d, 0)
    );

    // Declared `optional`: set to "" it is a key (once), not set it is none.
    let dir = tempfile::tempdir().unwrap();
    let p = num_format(&dir);
    let mut d = dedup_by(Format::Protobuf(p.clone()), "/opt");
    for set in [true, true, false] {
        let mut m = DynamicMessage::new(p.descriptor().clone());
        if set {
            m.set_field_by_name("opt", PValue::String(String::new()));
        }
        d.pipe(TestRecord::json(m.encode_to_vec())).unwrap();
    }
    let c = d.counts();
    assert_eq!(
        (c.passed, c.duplicates, c.dead_lettered),
        (1, 1, 1),
        "{c:?}"
    );
}

/// JSON into a protobuf sink: an integer beyond 64 bits reads as `f64`, and was written as
/// another number (2^64 as `u64::MAX`, -2^63 - 1 as `i64::MIN`); it is dead-lettered, as a
/// value that does not fit the message. A float with no fraction below 2^53 still fits.
#[test]
fn integers_beyond_a_protobuf_fields_range_are_dead_lettered_not_changed() {
    let dir = tempfile::tempdir().unwrap();
    let p = num_format(&dir);
    let t = TopologyBuilder::new("t")
        .source("in", Format::Json)
        .sink("out", "out.pb")
        .topic_format("out.pb", Format::Protobuf(p.clone()))
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json(r#"{"id":"a","u":18446744073709551616}"#))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"id":"b","n":-9223372036854775809}"#))
        .unwrap();
    d.pipe(TestRecord::json(r#"{"id":"c","n":1e3}"#)).unwrap();
    assert_eq!(d.dead_letters().len(), 2);
    assert!(
        dlq_reason(&d, 0).contains("field /u"),
        "{}",
        dlq_reason(&d, 0)
    );
    let out = d.output("out.pb");
    assert_eq!(out.len(), 1);
    let m =
        DynamicMessage::decode(p.descriptor().clone(), out[0].value.as_deref().unwrap()).unwrap();
    assert_eq!(
        serde_json::to_string(&m).unwrap(),
        r#"{"id":"c","n":"1000"}"#
    );
}

/// A CEL sink key or header from a JSON integer beyond 64 bits was the text of the `f64`
/// it rounds to (ids 2^64 and 2^64 + 1 both keyed `18446744073709552000`); it is refused
/// with a dead letter, and a double keeps its fraction (`1.0` is not the int `1`).
#[test]
fn a_cel_sink_key_never_rounds_an_integer_beyond_64_bits() {
    let t = onceflow::dsl::parse(
        "t.yaml",
        "name: t\nsource: { topic: in }\nstages:\n  - sink: { topic: out, key: 'value.id', headers: { id: 'value.id' } }\n",
    )
    .unwrap();
    let mut d = TestDriver::new(t);
    for id in ["18446744073709551616", "18446744073709551617", "1.0", "7"] {
        d.pipe(TestRecord::json(format!(r#"{{"id": {id}}}"#)))
            .unwrap();
    }
    let keys: Vec<String> = d
        .output("out")
        .iter()
        .map(|r| String::from_utf8(r.key.as_deref().unwrap().to_vec()).unwrap())
        .collect();
    assert_eq!(keys, ["1.0", "7"]);
    assert_eq!(d.dead_letters().len(), 2);
    assert!(
        dlq_reason(&d, 0).contains("past 2^53"),
        "{}",
        dlq_reason(&d, 0)
    );
}

/// A protobuf `float` read as the `f64` of its bits (`0.1` as `0.10000000149011612`): a
/// JSON sink wrote that and `value.f == 0.1` was false, where the same data as JSON passes.
/// The view holds the shortest decimal of the `f32`, as the protobuf JSON mapping writes.
#[test]
fn a_protobuf_float_reads_as_its_shortest_decimal() {
    let dir = tempfile::tempdir().unwrap();
    let p = num_format(&dir);
    let mut m = DynamicMessage::new(p.descriptor().clone());
    m.set_field_by_name("id", PValue::String("a".into()));
    m.set_field_by_name("f", PValue::F32(0.1));
    let bytes = m.encode_to_vec();
    let passes = |format: &str, value: Vec<u8>| {
        let y = format!("name: t\nsource: {{ topic: in, format: {format} }}\nstages:\n  - filter: {{ name: f, when: 'value.f == 0.1' }}\n  - sink: {{ topic: out }}\n");
        let mut d = TestDriver::new(onceflow::dsl::parse("t.yaml", &y).unwrap());
        d.pipe(TestRecord::json(value)).unwrap();
        d.output("out").len()
    };
    let proto_format = format!(
        "{{ protobuf: {{ descriptor_set: {}, message: t.Num }} }}",
        dir.path().join("num.desc").display()
    );
    assert_eq!(passes("json", br#"{"id":"a","f":0.1}"#.to_vec()), 1);
    assert_eq!(passes(&proto_format, bytes.clone()), 1);

    let t = TopologyBuilder::new("t")
        .source("in", Format::Protobuf(p))
        .sink("out", "out.json")
        .topic_format("out.json", Format::Json)
        .build()
        .unwrap();
    let mut d = TestDriver::new(t);
    d.pipe(TestRecord::json(bytes)).unwrap();
    assert_eq!(
        d.output_values("out.json"),
        [r#"{"id":"a","f":0.1,"u":0,"n":0}"#]
    );
}
