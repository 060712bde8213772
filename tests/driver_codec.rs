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
